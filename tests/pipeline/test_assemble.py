"""Assemble: a record's embeddings as raw bytes of the stored dtype, and a quarantine row that keeps its evidence."""

from __future__ import annotations

import pytest
import torch

from batchvlm.checks import CheckFailed, failure
from batchvlm.pipeline.assemble import embed_bytes, quarantine_row
from batchvlm.records import ImageRef, QuarantinedRecord, SourceRecord


def test_embeddings_of_every_image_are_one_run_of_little_endian_bytes_in_span_order():
    first, second = torch.arange(6.0).reshape(3, 2), torch.arange(6.0, 10.0).reshape(2, 2)
    data = embed_bytes([first, second], torch.bfloat16, hidden_size=2)
    back = torch.frombuffer(bytearray(data), dtype=torch.bfloat16).reshape(-1, 2)
    assert torch.equal(back.float(), torch.cat([first, second]))
    assert embed_bytes([], torch.float32, 2) == b""


def test_embeddings_that_do_not_fit_the_hidden_size_are_refused():
    with pytest.raises(CheckFailed) as caught:
        embed_bytes([torch.zeros(3, 4)], torch.float32, hidden_size=5)
    assert caught.value.check == "assemble.embed_bytes"


def test_a_quarantine_row_keeps_small_images_and_only_the_path_of_large_ones():
    source = SourceRecord("r1", "u", "a.parquet", 7, "<image> <image>",
                          [ImageRef(data=b"x" * 10), ImageRef(data=b"y" * 100, path="big.jpg")])
    item = QuarantinedRecord(source, failure("decode.truncated", "cut short", "whole", "half"))
    row = quarantine_row(item, bytes_cap=50, fingerprint="f")
    assert row["image_bytes"] == [b"x" * 10, None] and row["image_paths"] == [None, "big.jpg"]
    assert (row["check"], row["stage"], row["row"], row["unit"]) == ("decode.truncated", "decode", 7, "u")


def test_a_quarantine_row_writes_whatever_its_record_held_its_unencodable_strings_escaped_and_says_so():
    """A tar key that is not UTF-8 (read with surrogateescape), a surrogate in an error message: the row still writes."""
    import pyarrow as pa

    from batchvlm.format.schema import QUARANTINE_SCHEMA
    from batchvlm.records import Turn

    key = b"d\xf6g".decode("utf-8", "surrogateescape")
    source = SourceRecord(key, "u", "a.tar", 1, "", [ImageRef(path=f"a.tar#{key}.jpg")])
    source.turns = [Turn("user", ("Hi \ud800",))]
    item = QuarantinedRecord(source, failure("source.bad_metadata", "bad \udcff json", "an object", "\ud800"))
    row = quarantine_row(item, bytes_cap=50, fingerprint="f")
    table = pa.Table.from_pylist([row], schema=QUARANTINE_SCHEMA)
    assert table.column("id").to_pylist() == ["d\\xf6g"] and row["image_paths"] == ["a.tar#d\\xf6g.jpg"]
    assert row["turns"] == [{"role": "user", "text": "Hi \\ud800"}] and row["observed"] == "\\ud800"
    assert row["message"].startswith("bad \\xff json") and "stored escaped: id, message, observed, image_paths, " \
        "turns" in row["message"]


def chat_layout(mask: list[int]):
    """user [0, 4) with an image token at 2, assistant [4, 7): tags and turns of a tiny conversation."""
    from batchvlm.records import ChatLayout, TokenLayout, TurnSpan

    return TokenLayout(input_ids=list(range(7)), image_spans=[(2, 1)], token_tags=[0, 2, 1, 2, 0, 0, 0],
                       chat=ChatLayout(mask, [TurnSpan("user", 0, 4), TurnSpan("assistant", 4, 7)]))


@pytest.mark.parametrize("mask,train_on,ok", [
    ([0, 0, 0, 0, 1, 1, 1], "assistant", True),
    ([0, 0, 1, 0, 1, 1, 1], "assistant", False),  # an image token trained
    ([1, 0, 0, 0, 1, 1, 1], "assistant", False),  # a user token trained
    ([1, 1, 0, 1, 1, 1, 1], "all", True),  # everything but the image
    ([1, 1, 1, 1, 1, 1, 1], "all", False),
    ([0, 0, 0, 1, 1, 1], "assistant", False),  # does not cover the sequence
])
def test_a_loss_mask_lies_only_on_assistant_tokens_and_never_on_an_image(mask, train_on, ok):
    from batchvlm.pipeline.assemble import checked_chat

    layout = chat_layout(mask)
    if ok:
        assert checked_chat(layout, train_on) is layout.chat
        return
    with pytest.raises(CheckFailed) as caught:
        checked_chat(layout, train_on)
    assert caught.value.check == "assemble.loss_mask"


def test_a_quarantined_conversation_keeps_its_turns_and_the_turn_at_fault():
    from batchvlm.records import Turn

    source = SourceRecord("c1", "u", "a.json", 120, "[...]", [ImageRef(path="cat.png")],
                          turns=[Turn("user", (None, " What?")), Turn("assistant", ("A cat.",))])
    failed = CheckFailed("text.too_long", "too long", "<= 8 tokens", "20 tokens", turn_index=1).to_failure()
    row = quarantine_row(QuarantinedRecord(source, failed), bytes_cap=10, fingerprint="f", placeholder="<img>")
    assert row["turns"] == [{"role": "user", "text": "<img> What?"}, {"role": "assistant", "text": "A cat."}]
    assert row["turn_index"] == 1
