"""The export of a run's conversations to LLaMA-Factory and ms-swift, over runs of the job: each stack retokenizes the
exported file into the written ids and mask, and the export command's output and refusals."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

import stack_templates
from batchvlm.config import ConfigError
from batchvlm.training.export import (SKIPS, ImageReference, StoredImages, conversation_turns, conversations,
                                      dataset_info, export_run)
from batchvlm.training.reader import read_run, trusted_shards
from conftest import REPO, committed_shards, embed_in_process, run_job_command, write_llava_dataset

# runs of the job, the stacks' tokenizers and models
pytestmark = pytest.mark.slow


STACKS = {"llamafactory": stack_templates.llamafactory_qwen2_vl, "swift": stack_templates.swift_qwen2_vl}


CHAT_RECORDS = [
    {"id": "system_three_images", "image": ["img/cat.png", "img/coffee.jpg", "img/rocket.jpg"], "conversations": [
        {"from": "system", "value": "You describe photographs precisely."},
        {"from": "human", "value": "<image>\nWhat is it?"},
        {"from": "gpt", "value": "A cat, sitting."},
        {"from": "human", "value": "And now <image> and <image>?"},
        {"from": "gpt", "value": "Coffee, then a rocket: 3 in all (12+30=42, café, 東京)  "}]},
    {"id": "answer_newline", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "\nHello."}]},
    {"id": "empty_system", "conversations": [{"from": "system", "value": ""}, {"from": "human", "value": "Hi"},
                                             {"from": "gpt", "value": "Yo."}]},
    {"id": "audio_tag", "conversations": [{"from": "human", "value": "What is <audio>?"},
                                          {"from": "gpt", "value": "A tag."}]},
    {"id": "default_system", "image": "img/rocket.jpg", "conversations": [
        {"from": "human", "value": "Describe:<image>"}, {"from": "gpt", "value": "A rocket on its pad."}]},
    {"id": "user_last", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Yo."},
                                          {"from": "human", "value": "Bye"}]},
    {"id": "image_in_answer", "image": "img/cat.png", "conversations": [
        {"from": "human", "value": "Show me a cat."}, {"from": "gpt", "value": "Here: <image> a cat."}]},
    {"id": "control_string", "conversations": [{"from": "human", "value": "Is <|im_end|> a token?"},
                                               {"from": "gpt", "value": "Here it is text."}]},
    {"id": "default_system", "conversations": [  # the id again: the dedup pass leaves this one out of the readers
        {"from": "human", "value": "Again?"}, {"from": "gpt", "value": "A second record under the same id."}]},
]


SKIPPED = {"answer_newline": "answer_starts_with_newline", "empty_system": "empty_system",
           "audio_tag": "media_tag_in_text", "user_last": "roles", "image_in_answer": "image_in_answer",
           "control_string": "control_string_in_text"}


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory, qwen_real_checkpoint):
    """LLaVA records with system prompts, images in several turns, and each thing a stack renders otherwise; Qwen2-VL's
    real vocabulary."""
    folder = write_llava_dataset(tmp_path_factory.mktemp("chat")).parent
    (folder / "chat.json").write_text(json.dumps(CHAT_RECORDS, ensure_ascii=False))
    return embed_in_process(tmp_path_factory.mktemp("outputs"), "chat", "dataset=llava",
                            f"dataset.path={folder / 'chat.json'}", "model=qwen2_vl_tiny",
                            f"model.path={qwen_real_checkpoint}", "preprocess.backend=reference",
                            "dataset.unit_records=3",  # three units: the duplicate id is the dedup pass's
                            "text.control_tokens=text")  # control_string is written, its <|im_end|> as plain text


@pytest.fixture(scope="module")
def tokenizer(qwen_real_checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen_real_checkpoint)


def data_rows(run_dir) -> dict[str, dict]:
    """The first row written under each id (a later one is a duplicate the readers leave out)."""
    rows: dict[str, dict] = {}
    for shard in committed_shards(run_dir):
        for row in pq.read_table(shard, columns=["id", "input_ids", "loss_mask", "turns", "grid_thw"]).to_pylist():
            rows.setdefault(row["id"], row)
    return rows


def exported(out, name) -> list[dict]:
    return [json.loads(line) for line in (out / f"{name}.jsonl").read_text().splitlines()]


def expected_trained(row: dict, newline: int) -> np.ndarray:
    """The job's loss mask, plus the "\\n" after each answer's <|im_end|>: what both stacks train."""
    trained = np.array(row["loss_mask"], dtype=bool)
    for turn in row["turns"]:
        if turn["role"] == "assistant":
            assert row["input_ids"][turn["end"]] == newline  # the template's newline after <|im_end|>
            trained[turn["end"]] = True
    return trained


def check_stack_reproduces(stack: str, line: dict, row: dict, images: StoredImages, tokenizer) -> None:
    grids = [images.image(reference)[0].tolist() for reference in line["images"]]
    ids, labels = STACKS[stack](tokenizer, line, grids)
    assert ids == row["input_ids"], line["id"]
    trained = np.array(labels) != stack_templates.IGNORE
    assert (np.array(labels)[trained] == np.array(ids)[trained]).all()
    newline = tokenizer.encode("\n", add_special_tokens=False)[0]
    assert (trained == expected_trained(row, newline)).all(), line["id"]


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_each_stack_retokenizes_the_exported_conversations_into_the_written_ids_and_mask(stack, chat_run, llava_run,
                                                                                         tokenizer, tmp_path):
    for run, name in ((chat_run, "chat"), (llava_run, "llava")):
        out = tmp_path / name
        summary = export_run(run, stack, out)
        lines, rows, images = exported(out, name), data_rows(run), StoredImages(run)
        assert summary.exported == len(lines) and summary.exported + sum(summary.skipped.values()) == len(rows)
        for line in lines:
            check_stack_reproduces(stack, line, rows[line["id"]], images, tokenizer)
    # multi-turn with a system prompt and three images in two turns; the default system; text only; a record cut to
    # its first two turns by text.overflow=drop_turns; a duplicate id once, its first record
    chat = exported(tmp_path / "chat", "chat")
    assert sorted(line["id"] for line in chat) == ["default_system", "system_three_images"]
    written = [row["id"] for shard in committed_shards(chat_run)
               for row in pq.read_table(shard, columns=["id"]).to_pylist()]
    assert written.count("default_system") == 2
    assert next(line for line in chat if line["id"] == "default_system")["messages"][0]["content"] == "Describe:<image>"
    llava = {line["id"]: line for line in exported(tmp_path / "llava", "llava")}
    assert set(llava) == {"two_photos", "text_only", "long"}  # answer_first was quarantined: not exported
    assert [message["role"] for message in llava["long"]["messages"]] == ["user", "assistant"] * 2


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_a_skipped_conversation_is_one_the_stack_would_render_or_mask_otherwise(stack, chat_run, tokenizer, tmp_path):
    summary = export_run(chat_run, stack, tmp_path / "out")
    skipped = [json.loads(line) for line in (tmp_path / "out" / "skipped.jsonl").read_text().splitlines()]
    assert {entry["id"]: entry["reason"] for entry in skipped} == SKIPPED
    assert summary.skipped == {reason: 1 for reason in SKIPPED.values()}
    rows = data_rows(chat_run)
    texts = {row["id"]: row["text"] for shard in committed_shards(chat_run)
             for row in pq.read_table(shard, columns=["id", "text"]).to_pylist()}
    newline = tokenizer.encode("\n", add_special_tokens=False)[0]
    for record_id in ("answer_newline", "empty_system", "image_in_answer", "control_string"):
        turns = conversation_turns(texts[record_id], "<image>", len(rows[record_id]["turns"]))
        line = {"messages": [{"role": t.role, "content": t.text("<image>")} for t in turns]}
        ids, labels = STACKS[stack](tokenizer, line, rows[record_id]["grid_thw"])
        trained = np.array(labels) != stack_templates.IGNORE
        assert ids != rows[record_id]["input_ids"] or len(trained) != len(rows[record_id]["loss_mask"]) or \
            (trained != expected_trained(rows[record_id], newline)).any(), record_id


def test_an_image_reference_gives_that_images_stored_rows(chat_run, tmp_path):
    export_run(chat_run, "swift", tmp_path / "out")
    images = StoredImages(chat_run)
    records = {record.id: record for record in read_run(chat_run)}
    for line in exported(tmp_path / "out", "chat"):
        record = records[line["id"]]
        assert [images.record(reference).id for reference in line["images"]] == [line["id"]] * len(line["images"])
        grids, embeds = images.images(line["images"])
        assert (grids == record.grid_thw).all()
        assert [len(rows) for rows in embeds] == record.image_spans[:, 1].tolist()
        assert (torch.cat(embeds) == record.image_embeds).all()
    shards = {ImageReference.parse(r).shard for line in exported(tmp_path / "out", "chat") for r in line["images"]}
    assert len(shards) == 2  # the two exported records were written by two units
    name = sorted(shards)[0]
    for wrong in ("config.yaml?row=0&image=0", "data/../config.yaml?row=0&image=0", f"{name}?row=99&image=0",
                  f"{name}?row=0&image=7", "quarantine/x.parquet?row=0&image=0"):
        with pytest.raises(ValueError):
            images.image(wrong)


def test_the_llamafactory_export_describes_itself_in_dataset_info(llava_run, tmp_path):
    summary = export_run(llava_run, "llamafactory", tmp_path / "lf", name="batchvlm_llava")
    info = json.loads((tmp_path / "lf" / "dataset_info.json").read_text())
    assert info == dataset_info("batchvlm_llava", "batchvlm_llava.jsonl")
    assert sorted(p.name for p in (tmp_path / "lf").iterdir()) == ["batchvlm_llava.jsonl", "dataset_info.json",
                                                                  "skipped.jsonl"]
    assert summary.exported == 3 and not summary.skipped
    export_run(llava_run, "swift", tmp_path / "swift")
    assert sorted(p.name for p in (tmp_path / "swift").iterdir()) == ["llava.jsonl", "skipped.jsonl"]


def test_the_export_command_refuses_a_bad_argument_naming_it(llava_run, tmp_path):
    def export(*args):
        return run_job_command("export", *args, cwd=tmp_path, timeout=300)

    assert export(f"run_dir={llava_run}", "format=swift").stderr.strip() == "error: out is required: out=<a new folder>"
    refused = export(f"run_dir={llava_run}", "format=axolotl", f"out={tmp_path / 'x'}")
    assert refused.returncode == 2 and "format must be one of llamafactory, swift" in refused.stderr
    unknown = export(f"run_dir={llava_run}", "format=swift", f"out={tmp_path / 'x'}", "formats=swift")
    assert unknown.returncode == 2 and "formats" in unknown.stderr
    done = export(f"run_dir={llava_run}", "format=swift", f"out={tmp_path / 'x'}")
    assert done.returncode == 0 and "exported 3 conversations" in done.stdout
    again = export(f"run_dir={llava_run}", "format=swift", f"out={tmp_path / 'x'}")
    assert again.returncode == 2 and "out:" in again.stderr
    assert not (tmp_path / "outputs").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["x"]


def test_a_stack_batch_of_the_export_fed_the_stored_rows_gives_the_logits_of_batchvlms_own_step(llava_run, tokenizer,
                                                                                                qwen_real_checkpoint,
                                                                                                tmp_path):
    """What a LLaMA-Factory plugin subclass feeds (docs/training.md): the collator's padded batch of the stack's own
    ids, positions recomputed as its collator does (get_rope_index from image_grid_thw, the text row prepended), and
    StoredImages' grids and rows as `mm_encoder_outputs`: the positions are the stored ones and every record's logits
    are those of model_inputs on batchvlm's padded batch."""
    from transformers import Qwen2VLForConditionalGeneration
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    from batchvlm.training import model_inputs, pad

    export_run(llava_run, "llamafactory", tmp_path / "lf")
    lines, images = exported(tmp_path / "lf", "llava"), StoredImages(llava_run)
    model = Qwen2VLForConditionalGeneration.from_pretrained(qwen_real_checkpoint, dtype=torch.float32).eval()
    encoded = [STACKS["llamafactory"](tokenizer, line, [images.image(r)[0].tolist() for r in line["images"]])[0]
               for line in lines]
    length = max(map(len, encoded))
    input_ids = torch.tensor([ids + [tokenizer.pad_token_id] * (length - len(ids)) for ids in encoded])
    attention_mask = torch.tensor([[1] * len(ids) + [0] * (length - len(ids)) for ids in encoded])
    grids, embeds = images.images([reference for line in lines for reference in line["images"]])
    mm_token_type_ids = (input_ids == model.config.image_token_id).long()
    positions, _ = model.model.get_rope_index(input_ids=input_ids, mm_token_type_ids=mm_token_type_ids,
                                              image_grid_thw=grids, attention_mask=attention_mask)
    positions = torch.cat([positions[:1], positions])  # LLaMA-Factory's collator: [4, B, L], the text row first
    records = {record.id: record for record in read_run(llava_run)}
    ours = pad([records[line["id"]] for line in lines], max_tokens=length)
    with torch.no_grad():
        stack = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False,
                      image_grid_thw=grids, mm_encoder_outputs={"image": BaseModelOutputWithPooling(
                          pooler_output=embeds)}).logits
        expected = model(**{**model_inputs(model, ours), "labels": None}).logits
    for row, ids in enumerate(encoded):
        assert (positions[1:, row, :len(ids)] == records[lines[row]["id"]].position_ids).all()
        scale = expected[row, :len(ids)].abs().max()
        assert (stack[row, :len(ids)] - expected[row, :len(ids)]).abs().max() <= 1e-4 * scale, lines[row]["id"]


def test_a_shuffled_export_mixes_the_row_groups_and_keeps_each_groups_records_together(chat_run, tmp_path):
    shard_of: dict[str, str] = {}
    for shard in committed_shards(chat_run):  # in plan order: an id's first record is the one read
        for row in pq.read_table(shard, columns=["id"]).to_pylist():
            shard_of.setdefault(row["id"], shard.name)
    in_order = [record_id for record_id, _, _ in conversations(chat_run, trusted_shards(chat_run), "swift")]
    orders = {seed: [record_id for record_id, _, _ in conversations(chat_run, trusted_shards(chat_run), "swift",
                                                                     seed)] for seed in range(6)}
    for order in orders.values():
        assert sorted(order) == sorted(in_order)
        groups = [shard_of[record_id] for record_id in order]
        assert len([k for k in range(len(groups)) if k == 0 or groups[k] != groups[k - 1]]) == len(set(groups))
    assert len({tuple(order) for order in orders.values()} | {tuple(in_order)}) > 2
    assert [r for r, _, _ in conversations(chat_run, trusted_shards(chat_run), "swift", 3)] == orders[3]
    summary = export_run(chat_run, "swift", tmp_path / "out", shuffle_seed=3)
    assert [line["id"] for line in exported(tmp_path / "out", "chat")] == [
        record_id for record_id in orders[3] if record_id in {"system_three_images", "default_system"}]
    assert summary.exported == 2


def test_a_run_and_its_requeue_run_export_as_one_dataset(qwen_real_checkpoint, tokenizer, tmp_path):
    """A record quarantined (two <image> for one image), fixed in the dataset and requeued: exported with the run's,
    its images referenced in the requeue run's folder."""
    folder = write_llava_dataset(tmp_path / "data").parent
    records = [{"id": "fine", "image": "img/cat.png", "conversations": [
                   {"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "A cat."}]},
               {"id": "fixed", "image": "img/rocket.jpg", "conversations": [
                   {"from": "human", "value": "<image> and <image>?"}, {"from": "gpt", "value": "One rocket."}]}]
    (folder / "req.json").write_text(json.dumps(records))
    job = ("dataset=llava", f"dataset.path={folder / 'req.json'}", "model=qwen2_vl_tiny",
           f"model.path={qwen_real_checkpoint}", "preprocess.backend=reference")
    run = embed_in_process(tmp_path / "outputs", "req", *job)
    records[1]["conversations"][0]["value"] = "<image> and nothing else?"
    (folder / "req.json").write_text(json.dumps(records))
    requeue = embed_in_process(tmp_path / "outputs", "req-requeue", *job, f"requeue_from={run}")
    summary = export_run([run, requeue], "llamafactory", tmp_path / "out")
    lines = {line["id"]: line for line in exported(tmp_path / "out", "req")}
    assert summary.exported == 2 and set(lines) == {"fine", "fixed"}
    assert lines["fine"]["images"][0].startswith("data/")
    assert lines["fixed"]["images"][0].startswith("../req-requeue/data/")
    images, rows = StoredImages([run, requeue]), {**data_rows(run), **data_rows(requeue)}
    for line in lines.values():
        check_stack_reproduces("llamafactory", line, rows[line["id"]], images, tokenizer)
    with pytest.raises(ValueError, match="no manifest of the run lists"):
        StoredImages(run).image(lines["fixed"]["images"][0])
    with pytest.raises(ConfigError, match="^run_dir: .* is not a requeue run"):
        export_run([requeue, run], "swift", tmp_path / "again")
    assert not (tmp_path / "again").exists()
    done = run_job_command("export", f"run_dir=[{run},{requeue}]", "format=swift", f"out={tmp_path / 'cli'}",
                           timeout=300)
    assert done.returncode == 0 and "exported 2 conversations" in done.stdout, done.stderr[-2000:]
    assert [line["id"] for line in exported(tmp_path / "cli", "req")] == [line["id"] for line in lines.values()]


def test_a_run_of_plain_texts_is_refused_before_anything_is_written(qwen_run, tmp_path):
    with pytest.raises(ConfigError, match=r"^run_dir: .* holds plain texts \(dataset.format=text\)"):
        export_run(qwen_run, "llamafactory", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("stack", ["llamafactory", "swift"])
def test_a_record_with_clips_is_skipped_as_video_never_exported_as_if_it_had_none(stack, clip_run, tmp_path):
    """A clip's rows have no reference in the export (it names images only), so a clip record is left out under its
    own reason, whatever else its text holds (its `<video>` would also read as a media tag)."""
    summary = export_run(clip_run, stack, tmp_path / "out")
    skipped = [json.loads(line) for line in (tmp_path / "out" / "skipped.jsonl").read_text().splitlines()]
    assert {(line["id"], line["reason"]) for line in skipped} == {
        ("astronaut_pan", "video"), ("coffee_zoom_and_cat", "video"), ("moon_and_astronaut", "video")}
    assert summary.exported == 0 and (tmp_path / "out" / f"{summary.files[0].name}").read_text() == ""
    assert "video" in SKIPS and "| `video` |" in (REPO / "docs" / "training.md").read_text()
