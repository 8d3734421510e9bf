"""Conversation formats read into turns, from every source: Parquet, WebDataset, save_to_disk, JSON and JSON Lines."""

from __future__ import annotations

import io
import json
import tarfile

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchvlm.checks import CheckFailed
from batchvlm.sources.config import dataset_config
from batchvlm.records import Slot, Turn
from batchvlm.sources import make_source
from batchvlm.pipeline.tokens import place_conversation_images
from batchvlm.sources.conversations import cauldron_turns, llava_turns, messages_turns, read_turns, split_placeholders

LLAVA = [{"from": "system", "value": "Answer briefly."},
         {"from": "human", "value": "Render a clear summary of the photo.\n<image>"},
         {"from": "gpt", "value": "A cat  on a mat.\n"},
         {"from": "human", "value": "<image>\nAnd  this <image> pair?"},
         {"from": "gpt", "value": "Two cups."}]


def test_a_llava_placeholder_stays_where_it_is_with_the_text_around_it_unchanged():
    turns = llava_turns(LLAVA, "<image>")
    assert [t.role for t in turns] == ["system", "user", "assistant", "user", "assistant"]
    assert turns[1].content == ("Render a clear summary of the photo.\n", None)
    assert turns[2].content == ("A cat  on a mat.\n",)  # whitespace included
    assert turns[3].content == (None, "\nAnd  this ", None, " pair?")
    assert sum(t.num_images for t in turns) == 3


def test_llavas_own_placement_moves_a_lone_image_first_only_when_asked():
    turns = llava_turns(LLAVA, "<image>", image_first=True)
    assert turns[1].content == (None, "\nRender a clear summary of the photo.")
    assert turns[3].content == (None, "\nAnd  this ", None, " pair?")  # two images: not a lone one


def test_messages_take_blocks_or_strings_with_placeholders():
    turns = messages_turns([
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Who are they?"}]},
        {"role": "assistant", "content": "Kane and Gretzka."},
        {"role": "user", "content": "What are they doing?<image>"}], "<image>")
    assert [t.content for t in turns] == [(None, "Who are they?"), ("Kane and Gretzka.",),
                                          ("What are they doing?", None)]


def test_a_block_of_unknown_type_is_refused_naming_its_turn():
    with pytest.raises(CheckFailed) as caught:
        messages_turns([{"role": "user", "content": [{"type": "audio"}]}], "<image>")
    assert caught.value.check == "text.placeholder_count" and caught.value.turn_index == 0


def test_cauldron_images_go_before_the_first_user_turn():
    turns = cauldron_turns([{"user": "Question: what?", "assistant": "Answer: B", "source": "AI2D"},
                            {"user": "Why?", "assistant": "Because."}], num_images=2)
    assert turns == [Turn("user", (None, None, "Question: what?")), Turn("assistant", ("Answer: B",)),
                     Turn("user", ("Why?",)), Turn("assistant", ("Because.",))]


def test_images_without_any_placeholder_go_first_in_the_first_user_turn_or_are_counted():
    turns = messages_turns([{"role": "system", "content": "S"}, {"role": "user", "content": "What color?"},
                            {"role": "assistant", "content": "Blue."}], "<image>")
    placed = place_conversation_images(turns, 1, "prepend")
    assert placed[1].content == (None, "What color?")
    with pytest.raises(CheckFailed) as caught:
        place_conversation_images(turns, 1, "quarantine")
    assert caught.value.check == "text.placeholder_count"
    with pytest.raises(CheckFailed):  # placeholders there, but not one per image: never guessed
        place_conversation_images(llava_turns(LLAVA, "<image>"), 2, "prepend")


@pytest.mark.parametrize("value", ["not json", json.dumps({"from": "human"}), json.dumps(["x"])])
def test_a_column_that_is_no_list_of_turns_is_a_roles_failure(value):
    with pytest.raises(CheckFailed) as caught:
        llava_turns(value, "<image>")
    assert caught.value.check == "text.roles"


def test_split_placeholders_keeps_every_character():
    text = " a<image><image>b\n<image>"
    parts = split_placeholders(text, "<image>")
    assert parts == (" a", None, None, "b\n", None)
    assert "".join("<image>" if p is None else p for p in parts) == text


# -- every format from every source ------------------------------------------------------------------------------------
RECORDS = [
    {"id": "a", "image": ["a.png"], "conversations": LLAVA[:3]},
    {"id": "b", "image": ["b.png", "c.png"], "conversations": [{"from": "human", "value": "<image> vs <image>"},
                                                               {"from": "gpt", "value": "Same."}]},
]


def write_parquet(folder, records):
    path = folder / "part.parquet"
    pq.write_table(pa.Table.from_pylist(records), path)
    return dict(kind="parquet", path=str(path))


def write_jsonl(folder, records):
    path = folder / "part.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return dict(kind="json", path=str(path))


def write_json_array(folder, records):
    path = folder / "part.json"
    path.write_text(json.dumps(records, indent=2))
    return dict(kind="json", path=str(path))


def write_disk(folder, records):
    datasets.Dataset.from_list(records).save_to_disk(str(folder / "ds"))
    return dict(kind="disk", path=str(folder / "ds"))


def write_webdataset(folder, records):
    path = folder / "shard.tar"
    with tarfile.open(path, "w") as tar:
        for record in records:
            blob = json.dumps(record).encode()
            info = tarfile.TarInfo(f"{record['id']}.json")
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
    return dict(kind="webdataset", path=str(path), id_column="id")


@pytest.mark.parametrize("write", [write_parquet, write_jsonl, write_json_array, write_disk, write_webdataset])
def test_llava_records_read_the_same_from_every_source(tmp_path, write):
    options = write(tmp_path, RECORDS)
    cfg = dataset_config(**{"id_column": "id", **options}, format="llava", images_column="image",
                         text_column="conversations", image_root="/images")
    source = make_source(cfg)
    records = [record for unit in source.plan() for record in source.records(unit)]
    assert [r.id for r in records] == ["a", "b"] and all(r.failure is None for r in records)
    assert records[0].turns == llava_turns(LLAVA[:3], "<image>")
    assert [[ref.path for ref in r.images] for r in records] == [["/images/a.png"], ["/images/b.png", "/images/c.png"]]
    assert json.loads(records[1].text) == [{"role": "user", "content": "<image> vs <image>"},
                                           {"role": "assistant", "content": "Same."}]


# -- values a record may hold -------------------------------------------------------------------------------------------
NOT_STRINGS = [None, True, 3, 2.5, ["a"], {"a": 1}]


@pytest.mark.parametrize("value", NOT_STRINGS, ids=repr)
@pytest.mark.parametrize("format,turns,turn_index", [
    ("llava", lambda v: [{"from": v, "value": "Hi"}, {"from": "gpt", "value": "Yo"}], 0),
    ("llava", lambda v: [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": v}], 1),
    ("messages", lambda v: [{"role": v, "content": "Hi"}, {"role": "assistant", "content": "Yo"}], 0),
    ("messages", lambda v: [{"role": "user", "content": v}, {"role": "assistant", "content": "Yo"}], 0),
    ("messages", lambda v: [{"role": "user", "content": "Hi"},
                            {"role": "assistant", "content": [{"type": "text", "text": v}]}], 1),
    ("cauldron", lambda v: [{"user": v, "assistant": "Yo"}], 0),
    ("cauldron", lambda v: [{"user": "Hi", "assistant": "Yo"}, {"user": "Hi", "assistant": v}], 3),
], ids=["llava.from", "llava.value", "messages.role", "messages.content", "messages.text", "cauldron.user",
        "cauldron.assistant"])
def test_a_turn_value_or_role_that_is_not_a_string_is_named_never_rendered_as_its_str(format, turns, turn_index,
                                                                                       value):
    """A number would become its str(), a null an empty turn, a list a tokenizer's TypeError. (A list content in
    messages is a list of blocks: a string in it is a block of no type.)"""
    blocks = format == "messages" and isinstance(value, list) and turns(value)[0]["content"] is value
    with pytest.raises(CheckFailed) as caught:
        read_turns(format, turns(value), "<image>", 0)
    assert caught.value.check == ("text.placeholder_count" if blocks else "text.not_a_string")
    assert caught.value.turn_index == turn_index


@pytest.mark.parametrize("format,turns", [
    ("llava", [{"value": "Hi"}]), ("llava", [{"from": "human"}]), ("messages", [{"content": "Hi"}]),
    ("messages", [{"role": "user"}]), ("cauldron", [{"user": "Hi"}]), ("cauldron", [{"assistant": "Yo"}])])
def test_a_turn_missing_its_role_or_text_is_named(format, turns):
    with pytest.raises(CheckFailed) as caught:
        read_turns(format, turns, "<image>", 0)
    assert caught.value.check == "text.not_a_string"
    assert caught.value.turn_index == (1 if turns == [{"user": "Hi"}] else 0)  # a pair is a user and an answer


@pytest.mark.parametrize("format,turns", [
    ("llava", [{"from": "human", "value": "<video>\nWhat happens?<image>"}, {"from": "gpt", "value": "A dance."}]),
    ("messages", [{"role": "user", "content": "<video>\nWhat happens?<image>"},
                  {"role": "assistant", "content": "A dance."}]),
    ("messages", [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "\nWhat happens?"},
                                               {"type": "image"}]}, {"role": "assistant", "content": "A dance."}]),
])
def test_a_clip_takes_its_place_in_the_turn_beside_images(format, turns):
    """`<video>` in a llava or messages text, a {type: video} block: a clip's slot (Slot.VIDEO) where it stands."""
    user = read_turns(format, turns, "<image>", 1)[0]
    assert user.content == (Slot.VIDEO, "\nWhat happens?", None)
    assert (user.num_videos, user.num_images) == (1, 1)


@pytest.mark.parametrize("format,turns", [
    ("messages", [{"role": "user", "content": [{"type": "text", "text": "What? <video>"}]},
                  {"role": "assistant", "content": "A dance."}]),
    ("cauldron", [{"user": "Hi", "assistant": "It shows <video>."}]),
])
def test_a_video_placeholder_where_no_clip_can_be_placed_is_named(format, turns):
    """A `<video>` inside a text block (a clip's place is a block), or in The Cauldron's format (no video column)."""
    with pytest.raises(CheckFailed) as caught:
        read_turns(format, turns, "<image>", 0)
    assert caught.value.check == "text.video" and caught.value.turn_index in (0, 1)


@pytest.mark.parametrize("write", [write_parquet, write_jsonl, write_json_array, write_disk, write_webdataset])
@pytest.mark.parametrize("format, column, named, turns", [
    ("llava", "video", None, [{"from": "human", "value": "What happens?"}, {"from": "gpt", "value": "A ball rolls."}]),
    ("messages", "videos", None, [{"role": "user", "content": "What happens?"},
                                  {"role": "assistant", "content": "A ball rolls."}]),
    # LLaMA-Factory's ShareGPT video data: conversations of {from, value} beside a `videos` column
    ("llava", "videos", "videos", [{"from": "human", "value": "What happens?"},
                                   {"from": "gpt", "value": "A ball rolls."}]),
])
def test_a_record_naming_a_clip_without_its_placeholder_fails_the_placeholder_count_never_dropped(
        tmp_path, write, format, column, named, turns):
    """LLaVA-Video's `video` (ms-swift's and LLaMA-Factory's `videos`, the latter's ShareGPT under
    dataset.videos_column) is read as the record's clips, under dataset.image_root as images are; one the turns do not place is
    text.placeholder_count (never embedded without it); an empty value and an image record name none."""
    text, images = {"llava": ("conversations", "image"), "messages": ("messages", "images")}[format]
    rows = [{"id": "clip", text: turns, images: [], column: ["clips/a.mp4"]},
            {"id": "none", text: turns, images: [], column: []},
            {"id": "image", text: turns, images: [], column: None}]
    options = write(tmp_path, rows)
    cfg = dataset_config(**{"id_column": "id", **options}, format=format, images_column=images, text_column=text,
                         image_root="/images", videos_column=named)
    source = make_source(cfg)
    records = {r.id: r for unit in source.plan() for r in source.records(unit)}
    assert [ref.path for ref in records["clip"].videos] == ["/images/clips/a.mp4"]
    assert records["none"].videos == [] and records["image"].videos == []
    assert all(record.failure is None for record in records.values())
    with pytest.raises(CheckFailed) as caught:
        place_conversation_images(records["clip"].turns, 0, "prepend", len(records["clip"].videos))
    assert caught.value.check == "text.placeholder_count" and "1 video placeholder" in caught.value.message


def test_clip_bytes_in_a_parquet_videos_column_are_read_as_the_records_clips(tmp_path):
    """messages' `videos` holding the clips themselves (binary, or HF's {bytes, path} structs) as images may."""
    turns = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What?"}]},
             {"role": "assistant", "content": "A ball."}]
    rows = [{"id": "raw", "messages": json.dumps(turns), "images": [], "videos": [b"\x00\x00\x00\x18ftypmp42"]},
            {"id": "struct", "messages": json.dumps(turns), "images": [],
             "videos": [{"bytes": b"\x1aE\xdf\xa3", "path": "clip.webm"}]}]
    for index, row in enumerate(rows):
        folder = tmp_path / str(index)
        folder.mkdir()
        cfg = dataset_config(**write_parquet(folder, [row]), format="messages", images_column="images",
                             text_column="messages", id_column="id")
        source = make_source(cfg)
        (record,) = [r for unit in source.plan() for r in source.records(unit)]
        assert record.failure is None and record.turns[0].num_videos == 1
        assert [ref.data for ref in record.videos] == [b"\x00\x00\x00\x18ftypmp42" if index == 0 else b"\x1aE\xdf\xa3"]
