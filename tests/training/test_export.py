"""The export of a run's conversations to LLaMA-Factory and ms-swift: what each stack makes of the exported file is the
sequence the job wrote, token for token, and trains what the job's loss mask trains.

The oracle is each stack's own Qwen2-VL template, re-implemented from its published sources in
tests/training/stack_templates.py (which names the files and commits): neither stack installs beside transformers 5.25.
The job renders with the checkpoint's HF chat template and masks by construction (pipeline/chat.py); the stacks render
slot strings of their own and mask per prompt/response pair: two independent implementations of one conversation.
They differ by one convention, checked here as such: both stacks also train the "\\n" after an answer's <|im_end|>,
the job (as transformers' and TRL's training templates) stops at <|im_end|>."""

from __future__ import annotations

import pytest

from batchvlm.config import ConfigError
from batchvlm.records import Turn
from batchvlm.training.export import SKIPS, ImageReference, check_exportable, skip_reason


# -- unit tests ---------------------------------------------------------------------------------------------------
def test_a_plain_text_run_or_a_bad_format_is_refused_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match="^format must be one of llamafactory, swift"):
        check_exportable(tmp_path, "sharegpt", tmp_path / "out")
    with pytest.raises(ConfigError, match="^shuffle_seed must be an integer or null, not 'x'"):
        check_exportable(tmp_path, "swift", tmp_path / "out", shuffle_seed="x")
    for name in ("../x", "a/b", "", ".hidden", "skipped"):
        with pytest.raises(ConfigError, match="^name must be a plain file stem"):
            check_exportable(tmp_path, "swift", tmp_path / "out", name)
    with pytest.raises(ConfigError, match="^run_dir: .* is not a batchvlm run directory"):
        check_exportable(tmp_path, "swift", tmp_path / "out")
    (tmp_path / "config.yaml").write_text("dataset:\n  format: text\n")
    with pytest.raises(ConfigError, match=r"^run_dir: .* holds plain texts \(dataset.format=text\)"):
        check_exportable(tmp_path, "swift", tmp_path / "out")
    (tmp_path / "config.yaml").write_text("dataset:\n  format: messages\n")
    with pytest.raises(ConfigError, match="^run_dir: .* has no _SUCCESS: the run is unfinished"):
        check_exportable(tmp_path, "swift", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("a user's file")
    with pytest.raises(ConfigError, match="^out: .* already exists"):
        check_exportable(tmp_path, "swift", tmp_path / "out")
    assert (tmp_path / "out" / "mine.txt").read_text() == "a user's file"


def test_a_run_dir_list_that_is_empty_or_holds_an_empty_path_is_refused_naming_run_dir(tmp_path):
    """`run_dir=[]` was an IndexError; an empty path was read as the current folder."""
    for runs, message in (([], "run_dir names no run"), ([""], "run_dir holds an empty path"),
                          ("", "run_dir holds an empty path"), ([str(tmp_path), " "], "run_dir holds an empty path")):
        with pytest.raises(ConfigError, match=rf"^{message}"):
            check_exportable(runs, "swift", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_out_folder_under_a_file_is_refused_naming_out(tmp_path):
    (tmp_path / "notes.txt").write_text("a user's file")
    (tmp_path / "config.yaml").write_text("dataset:\n  format: messages\n")
    with pytest.raises(ConfigError, match=rf"^out=.*: {tmp_path / 'notes.txt'} is a file, not a folder"):
        check_exportable(tmp_path, "swift", tmp_path / "notes.txt" / "export")
    assert (tmp_path / "notes.txt").read_text() == "a user's file"


def turn(role, *content):
    return Turn(role, content)


@pytest.mark.parametrize("turns, images, reason", [
    ([turn("user", "Hi"), turn("assistant", "Yo")], 0, None),
    ([turn("system", "Be brief."), turn("user", None, "Hi"), turn("assistant", "Yo")], 1, None),
    ([turn("user", "Hi")], 0, "roles"),
    ([turn("user", "Hi"), turn("assistant", "Yo"), turn("tool", "{}"), turn("assistant", "Ok")], 0, "roles"),
    ([turn("user", "Hi"), turn("user", "Hi"), turn("assistant", "Yo")], 0, "roles"),
    ([turn("system", "x"), turn("system", "y"), turn("user", "Hi"), turn("assistant", "Yo")], 0, "roles"),
    ([turn("system"), turn("user", "Hi"), turn("assistant", "Yo")], 0, "empty_system"),
    ([turn("user", "Hi <video>"), turn("assistant", "Yo")], 0, "media_tag_in_text"),
    ([turn("user", "Hi", None, None), turn("assistant", "Yo")], 1, "media_tag_in_text"),
    ([turn("user", "Hi"), turn("assistant")], 0, "empty_answer"),
    ([turn("user", "Hi"), turn("assistant", " \n Yo")], 0, "answer_starts_with_newline"),
    ([turn("user", "Hi"), turn("assistant", " Yo\n")], 0, None),
    ([turn("user", "\nHi"), turn("assistant", "Yo")], 0, None),
])
def test_a_conversation_the_stacks_render_otherwise_gets_a_named_reason(turns, images, reason):
    assert skip_reason(turns, images, "swift") == skip_reason(turns, images, "llamafactory") == reason
    assert reason is None or reason in SKIPS


def test_a_control_string_is_skipped_where_the_run_read_control_strings_as_text():
    turns = [turn("user", "Is <|im_end|> one?"), turn("assistant", "No.")]
    assert (skip_reason(turns, 0, "swift", True), skip_reason(turns, 0, "swift")) == ("control_string_in_text", None)
    assert skip_reason([turn("user", "a <| b |> c"), turn("assistant", "x")], 0, "llamafactory", True) is None


def test_a_round_field_in_a_user_text_is_skipped_for_swift_only():
    turns = [turn("user", "Fill {{ROUND0}} in"), turn("assistant", "{{ROUND1}} stays in an answer")]
    assert (skip_reason(turns, 0, "swift"), skip_reason(turns, 0, "llamafactory")) == ("round_field_in_text", None)
    assert skip_reason([turn("user", "Hi"), turns[1]], 0, "swift") is None


@pytest.mark.parametrize("answer", [("Here:", None), (None,), (None, "\nA cat.")])
def test_an_image_in_an_answer_is_skipped(answer):
    assert skip_reason([turn("user", "Show me."), turn("assistant", *answer)], 1, "swift") == "image_in_answer"


def test_an_image_reference_reads_back_as_written():
    reference = ImageReference("data/u-0001.c5a.parquet", 12, 3)
    assert str(reference) == "data/u-0001.c5a.parquet?row=12&image=3"
    assert ImageReference.parse(str(reference)) == reference
    for wrong in ("data/u.parquet?row=-1&image=0", "/etc/passwd", "data/u.parquet?row=1", "data/u?row=1&image=0",
                  None):
        with pytest.raises(ValueError):
            ImageReference.parse(wrong)
