"""A worker's stream crosses to the main process in chunks: one crossing per chunk, its pixels in one shared block
handed over by reference, the items in their order."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from batchvlm.executor.transport import Chunk, ChunkedStream, Rings, chunked, rings_offset, unchunked
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


def test_a_ring_hands_out_its_free_run_in_order_and_takes_back_what_the_main_process_dropped():
    rings = Rings(1, size=100)
    writer = rings.writer(0)
    assert writer.free_run() == (0, 100)
    first = writer.taken((0, 100), (30,))
    assert writer.free_run() == (30, 70)
    writer.taken((30, 70), (40,))
    assert writer.free_run() == (70, 30)  # a 50-byte image does not fit: the decoder writes it to its arena instead
    chunk = Chunk([], worker=0, slices=writer.handed(), in_ring=[(0, 0, 0, (30,)), (0, 1, 30, (40,))])
    rings.arrived(chunk)
    views = [rings.view(0, start, rings_offset(rings, chunk, start, shape), shape)
             for _, _, start, shape in chunk.in_ring]
    first[:] = 7
    assert int(views[0].sum()) == 7 * 30  # the worker's bytes, seen by the main process, not copied
    del views[1]
    assert rings.released[0] == 0  # the first slice still held: nothing is given back out of order
    del views[0]
    assert rings.released[0] == 70
    place = writer.free_run()
    assert place == (0, 70)  # the longer run, from the ring's start: the 30 bytes at its end skipped
    writer.taken(place, (60,))
    rings.arrived(Chunk([], worker=0, slices=writer.handed()))  # an image that no record kept (quarantined)
    assert rings.released[0] == 160 and writer.free_run() == (0, 60)  # the longer run again


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (bash jobs/gpu_check.sh)")
def test_on_cuda_a_page_locked_rings_pixels_cross_to_the_device_from_the_ring_itself():
    from batchvlm.devices import gather_to

    rings = Rings(1, size=1 << 20)
    writer = rings.writer(0)
    ring_pixels = writer.taken(writer.free_run(), (10, 10, 3))
    ring_pixels[:] = 5
    chunk = Chunk([], worker=0, slices=writer.handed(), in_ring=[(0, 0, 0, (10, 10, 3))])
    rings.arrived(chunk)
    view = rings.view(0, 0, 0, (10, 10, 3))
    out = torch.empty(300 + 4, dtype=torch.uint8, device="cuda")
    rings.pin(torch.device("cuda"))
    assert view.is_pinned()
    gather_to([view, torch.full((4,), 9, dtype=torch.uint8)], out)
    torch.cuda.synchronize()
    assert out[:300].eq(5).all() and out[300:].eq(9).all()
