"""A worker's stream crosses to the main process in chunks: one crossing per chunk, its pixels in one shared block
handed over by reference, the items in their order."""

from __future__ import annotations

import pickle

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from batchvlm.executor.transport import ChunkedStream, chunked, unchunked
from batchvlm.records import (DecodedImage, EncodedJpeg, ImagePlan, PreparedRecord, QuarantinedRecord, SourceRecord,
                              TokenLayout, UnitEnd, UnitStart, WorkUnit)

UNIT = WorkUnit("u-0", "input", 0, 4)


def record(name: str, *pixels, patches: int = 10) -> PreparedRecord:
    images = [DecodedImage(p, "PNG", name) if isinstance(p, np.ndarray) else p for p in pixels]
    plans = [ImagePlan((1, 1), (1, 1), (1, 1), (1, 1, patches), patches) for _ in images]
    return PreparedRecord(SourceRecord(name, UNIT.unit_id, "input", 0, "", []), images, plans, TokenLayout([], [], []))


def photo(value: int, shape=(6, 5, 3)) -> np.ndarray:
    return np.full(shape, value, np.uint8)


class Stream(IterableDataset):
    def __init__(self, items):
        self.items = items

    def __iter__(self):
        return iter(self.items)


def stream_items() -> list:
    jpeg = EncodedJpeg(b"\xff\xd8 bytes", 4, 4, 1, "sha")
    return [UnitStart(UNIT, None), record("a", photo(1), photo(2, (3, 3, 4))), record("b", jpeg),
            QuarantinedRecord(SourceRecord("c", UNIT.unit_id, "input", 2, "", []), None), record("d"),
            record("e", photo(5)), UnitEnd(UNIT, 5)]


def test_a_chunk_closes_at_the_patch_budget_or_the_units_end_and_its_pixels_are_one_block():
    chunks = list(chunked(stream_items(), patch_budget=25, records=100))
    assert [len(chunk.items) for chunk in chunks] == [3, 4]  # a+b (30 patches) | c, d, e, the unit's end
    assert [chunk.block.numel() for chunk in chunks] == [6 * 5 * 3 + 3 * 3 * 4, 6 * 5 * 3]
    assert all(chunk.block.is_shared() for chunk in chunks)
    assert all(image.pixels is None for image in chunks[0].items[1].images)  # off the records: they cross once
    assert [len(chunk.items) for chunk in chunked(stream_items(), patch_budget=1000, records=2)] == [3, 3, 1]


def test_items_come_out_in_order_with_each_image_a_view_of_its_chunks_block():
    items = list(unchunked(chunked(stream_items(), patch_budget=25, records=100)))
    assert [type(item).__name__ for item in items] == ["UnitStart", "PreparedRecord", "PreparedRecord",
                                                       "QuarantinedRecord", "PreparedRecord", "PreparedRecord",
                                                       "UnitEnd"]
    first, second = items[1].images
    assert torch.equal(first.pixels, torch.full((6, 5, 3), 1, dtype=torch.uint8)) and second.pixels.shape == (3, 3, 4)
    assert first.pixels.untyped_storage().data_ptr() == second.pixels.untyped_storage().data_ptr()
    assert isinstance(items[2].images[0], EncodedJpeg) and int(items[5].images[0].pixels.sum()) == 5 * 90


def test_a_chunk_crosses_from_a_worker_process_as_one_shared_block_not_its_bytes():
    loader = DataLoader(ChunkedStream(Stream(stream_items()), patch_budget=25, records=100), batch_size=None,
                        num_workers=1, collate_fn=lambda item: item)
    items = list(unchunked(loader))
    pixels = items[1].images[0].pixels
    assert pixels.is_shared() and torch.equal(pixels, torch.full((6, 5, 3), 1, dtype=torch.uint8))
    assert [item.source.id for item in items if isinstance(item, PreparedRecord)] == ["a", "b", "d", "e"]
    big = list(chunked([record("big", photo(7, (1000, 1000, 3)))], patch_budget=25, records=100))[0]
    assert len(pickle.dumps(big.items)) < 10_000  # what crosses the pipe: the records without their pixels
