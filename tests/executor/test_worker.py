"""The worker side: a unit's rows checked as read, decoded, planned and laid out, between the unit's markers; units
already committed are never handed out; the rank's claims reach its workers through a queue, each unit one worker's,
claimed only as the workers need units."""

from __future__ import annotations

import dataclasses
import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from PIL import Image

from batchvlm.executor.config import JobConfig, RuntimeConfig
from batchvlm.executor.transport import Rings, ring_address
from batchvlm.executor.worker import (PreparedStream, QueuedUnits, checked_id, main_threads, prepared_units, rank_cores,
                                      text_side_of, worker_count)
from batchvlm.pipeline.decode import DecodeConfig
from batchvlm.sources.config import dataset_config
from batchvlm.records import PreparedRecord, QuarantinedRecord, SourceRecord, UnitEnd, UnitStart, WorkUnit
from batchvlm.rundir.claims import Claims
from batchvlm.rundir.layout import RunLayout
from batchvlm.rundir.frontier import claimed_units
from batchvlm.rundir.workunits import Block
from batchvlm.sources import make_source

UNIT = WorkUnit("input-00000000-00000004", "input", 0, 4)


def source_record(record_id: str | None, row: int = 0) -> SourceRecord:
    return SourceRecord(record_id, UNIT.unit_id, UNIT.source, row, "", [])


def test_a_row_without_an_id_or_seen_earlier_in_its_unit_is_quarantined_with_its_place():
    seen = set()
    assert checked_id(source_record("a"), UNIT, seen) is None
    again = checked_id(source_record("a", 2), UNIT, seen)
    missing = checked_id(source_record(None, 3), UNIT, seen)
    assert (again.failure.check, again.failure.stage) == ("source.duplicate_id", "source")
    assert missing.failure.check == "source.missing_id" and missing.source.id == "input#3"


def png() -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.full((40, 50, 3), 120, np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_a_worker_claims_each_unit_not_yet_committed_and_prepares_its_records(tmp_path, kimi_family):
    pq.write_table(pa.table({"id": ["a", "b", "c", "d"], "images": [[png()], [png()], [b"not an image"], []],
                             "text": ["<image> one", "<image> two", "<image> three", "no image"]}),
                   tmp_path / "in.parquet", row_group_size=2)
    job = JobConfig(dataset=dataset_config("parquet", path=str(tmp_path / "in.parquet"), unit_records=2),
                    decode=DecodeConfig(isolation="none"))
    source = make_source(job.dataset)
    units = source.plan()
    layout = RunLayout(tmp_path / "run")
    layout.manifests.mkdir(parents=True)
    layout.manifest(units[0].unit_id).write_text("{}")  # committed already
    claims = Claims(tmp_path / "claims", "rank00000-a", 60)
    block = Block(units[0].unit_id, tuple(units))  # one block of both units
    claimed = claimed_units(layout, {block.task: block}, [claims.claim_first(block.task)])
    items = list(PreparedStream(source, claimed, kimi_family, job, text_side_of(kimi_family, job)))
    assert isinstance(items[0], UnitStart) and items[0].unit == units[1] and isinstance(items[-1], UnitEnd)
    bad, text_only = items[1:3]
    assert isinstance(bad, QuarantinedRecord) and bad.failure.check == "decode.unreadable"
    assert isinstance(text_only, PreparedRecord) and text_only.plans == [] and text_only.source.id == "d"
    assert items[-1].num_records == 2


def test_the_ranks_claimed_units_reach_its_workers_each_once_claimed_only_as_they_are_needed():
    pulled = []

    def claimed():
        for number in range(10):
            pulled.append(number)
            yield number, None

    queued = QueuedUnits(claimed(), workers=2)
    queued.start()
    workers = [iter(queued), iter(queued)]
    got = [[], []]
    for turn in range(10):
        unit, _ = next(workers[turn % 2])
        got[turn % 2].append(unit)
        assert len(pulled) <= turn + 3  # the one taken, one in the queue, one the thread waits to put
    assert [next(worker, "ended") for worker in workers] == ["ended", "ended"]
    queued.check()
    assert sorted(got[0] + got[1]) == list(range(10))


def test_a_workers_decoded_pixels_reach_the_main_process_in_its_shared_ring_in_order(tmp_path, kimi_family):
    pq.write_table(pa.table({"id": ["a", "b", "c"], "images": [[png()], [png(), png()], [png()]],
                             "text": ["<image> one", "<image> <image> two", "<image> three"]}), tmp_path / "in.parquet")
    job = JobConfig(dataset=dataset_config("parquet", path=str(tmp_path / "in.parquet")),
                    runtime=RuntimeConfig(num_workers=1))
    source = make_source(job.dataset)
    layout = RunLayout(tmp_path / "run")
    layout.manifests.mkdir(parents=True)
    claims = Claims(tmp_path / "claims", "rank00000-a", 60)
    block = Block(source.plan()[0].unit_id, tuple(source.plan()))
    claimed = claimed_units(layout, {block.task: block}, [claims.claim_first(block.task)])
    rings = Rings(1)
    prepared, queued = prepared_units(source, claimed, kimi_family, job, text_side_of(kimi_family, job), rings)
    queued.start()
    records = [item for item in prepared if isinstance(item, PreparedRecord)]
    queued.check()
    assert [record.source.id for record in records] == ["a", "b", "c"]
    images = [image for record in records for image in record.images]
    ring = ring_address(rings.maps[0])
    assert len(images) == 4 and all(ring <= image.pixels.data_ptr() < ring + len(rings.maps[0])
                                    and int(image.pixels.float().mean()) == 120 for image in images)
    assert rings.released[0] == 0  # held while the records are alive
    del records, images
    assert rings.released[0] == 4 * 40 * 50 * 3  # given back, in order, once they are dropped


def test_a_rank_has_a_worker_per_core_but_the_main_process_and_its_main_process_the_cores_left(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    assert (rank_cores(), worker_count(None), worker_count(3)) == (16, 15, 3)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # 8 ranks on the node
    assert (rank_cores(), worker_count(None)) == (2, 1)
    threads = torch.get_num_threads()
    with main_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == threads


def test_the_main_process_takes_no_more_threads_than_omp_num_threads_allows(monkeypatch):
    """OMP_NUM_THREADS, where set (by a user, torchrun, accelerate, or the test suite for each of its workers), caps
    the main process's intra-op threads: past the cores it was given, OpenMP's threads spin while they wait."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    threads = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    with main_threads(0):
        assert torch.get_num_threads() == 16
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    with main_threads(0):
        assert torch.get_num_threads() == 2
    with main_threads(15):
        assert torch.get_num_threads() == 1
    assert worker_count(None) == 15  # the workers are not capped: each is a process of its own
    assert torch.get_num_threads() == threads


def test_a_plain_text_and_a_conversation_take_one_path_through_the_worker(kimi_family):
    """The worker lays out every record through its dataset's text side: a conversation rendered with the chat
    template (its loss mask and turns), a plain text tokenized piece by piece; the length limit is the same rule."""
    from batchvlm.pipeline.decode import Decoder
    from batchvlm.records import ImageRef, Turn
    from batchvlm.executor.worker import prepare

    image = ImageRef(data=png())
    turns = [Turn("user", (None, " What is it?")), Turn("assistant", ("A grey square.",))]
    decoder = Decoder(DecodeConfig(isolation="none"))
    for format, record in (("text", SourceRecord("t", "u", "s", 0, "<image> a grey square", [image])),
                           ("llava", SourceRecord("c", "u", "s", 1, "[...]", [image], turns=turns))):
        job = JobConfig(dataset=dataset_config("parquet", path="/x.parquet", format=format))
        prepared = prepare(record, kimi_family, job, decoder, text_side_of(kimi_family, job))
        assert isinstance(prepared, PreparedRecord) and (prepared.layout.chat is None) == (format == "text")
        limited = dataclasses.replace(job, text=dataclasses.replace(job.text, max_tokens=3))
        too_long = prepare(record, kimi_family, limited, decoder, text_side_of(kimi_family, limited))
        assert too_long.failure.check == "text.too_long"
        assert (too_long.failure.turn_index is None) == (format == "text")
