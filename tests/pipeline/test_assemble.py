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
