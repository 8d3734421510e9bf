"""The worker side of the job: in DataLoader worker processes, read the units the rank claimed, and decode, plan
and lay out each of their records, so that a decoder's crash or hang costs one record and the device never waits on
the CPU.

A worker yields, per unit it is handed, `UnitStart`, each record prepared (or quarantined), and `UnitEnd`.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch.utils.data import DataLoader, IterableDataset

from batchvlm.checks import CheckFailed, failure
from batchvlm.executor.config import JobConfig
from batchvlm.executor.transport import ChunkedStream, Rings, unchunked
from batchvlm.faults import crash_point
from batchvlm.pipeline.decode import Decoder
from batchvlm.pipeline.text import TextSide, laid_out, text_side
from batchvlm.pipeline.tokens import attach_positions
from batchvlm.records import (DecodedClip, ImageRef, PreparedRecord, QuarantinedRecord, SourceRecord, Turn, UnitEnd,
                              UnitStart, WorkUnit, clips_kept)
from batchvlm.rundir.claims import Claim
from batchvlm.sources import Source


def text_side_of(family, job: JobConfig) -> TextSide:
    """The text side of the job's dataset format (ConfigError before any work where it cannot be rendered)."""
    dataset = job.dataset
    return text_side(family, dataset.format, dataset.placeholder, dataset.missing_placeholder, job.text)


def prepare(record: SourceRecord, family, job: JobConfig, decoder: Decoder,
            text: TextSide) -> PreparedRecord | QuarantinedRecord:
    try:
        content = text.placed(record)
        images = [decoder(ref, index) for index, ref in enumerate(record.images)]
        clips = [decoded_clip(decoder, ref, index, family) for index, ref in enumerate(record.videos)]
        return plan_and_lay_out(record, content, images, family, job, text, clips)
    except CheckFailed as failed:
        return QuarantinedRecord(record, failed.to_failure())


def decoded_clip(decoder: Decoder, ref: ImageRef, index: int, family) -> DecodedClip:
    """A record's clip `index`, its frames sampled by the family's rule (text.placed has refused a clip to a family
    without one); a failure names the clip by its index."""
    try:
        clip = decoder.clip(ref, index, family.video_sampler())
    except CheckFailed as failed:
        failed.video_index, failed.image_index = index, None
        raise
    decoded = clip.decoded
    return DecodedClip(pixels=decoded.frames, indices=decoded.indices, timestamps_s=decoded.timestamps_s,
                       total_frames=clip.header.frames, fps=clip.header.fps)


def clip_plan(clip: DecodedClip, index: int, family):
    """The family's plan of a record's clip `index` (a failure names the clip)."""
    try:
        return family.plan_video(list(clip.indices), clip.total_frames, clip.fps, clip.height, clip.width,
                                 list(clip.timestamps_s))
    except CheckFailed as failed:
        failed.video_index = index
        raise


def plan_and_lay_out(record: SourceRecord, content: str | list[Turn], images: list, family, job: JobConfig,
                     text: TextSide, clips: list[DecodedClip] = ()) -> PreparedRecord:
    """The plan of each decoded image (and clip) and the record's token layout, whatever its text's format (raises
    CheckFailed)."""
    plans = [family.plan(image.height, image.width) for image in images]
    clip_plans = [clip_plan(clip, index, family) for index, clip in enumerate(clips)]
    layout = laid_out(text, content, plans, job.text, clip_plans)
    kept = len(layout.image_spans)  # the images of turns that text.overflow=drop_turns left out are not embedded
    images, plans = images[:kept], plans[:kept]
    kept_clips = clips_kept(clip_plans, len(layout.video_spans))
    clips, clip_plans = list(clips[:kept_clips]), clip_plans[:kept_clips]
    attach_positions(layout, plans, family, clip_plans)
    return PreparedRecord(source=record, images=images, plans=plans, layout=layout, clips=clips,
                          clip_plans=clip_plans)


def checked_id(record: SourceRecord, unit: WorkUnit, seen: set) -> QuarantinedRecord | None:
    """The source's checks of a row as read: it has an id, not seen earlier in the unit, and no source.* failure."""
    if record.id is None:
        record.id = f"{unit.source}#{record.row}"
        return QuarantinedRecord(record, failure("source.missing_id", "the id column is empty for this row (where "
                                                 "the dataset has no ids, dataset.missing_ids=content makes them)",
                                                 expected="a unique, non-empty id", observed=repr(record.id)))
    if record.failure is not None:
        return QuarantinedRecord(record, record.failure)
    if record.id in seen:
        return QuarantinedRecord(record, failure("source.duplicate_id", f"id {record.id!r} appeared earlier in this "
                                                 "unit", expected="a unique, non-empty id", observed=repr(record.id)))
    seen.add(record.id)
    return None


class PreparedStream(IterableDataset):
    """Yields, per unit it is handed (with the claim on the unit's block), the start marker, the unit's records
    prepared, and the end marker. `units` is the rank's claimed units themselves where the stream runs inline, or
    the queue they come through (QueuedUnits) in DataLoader workers."""

    def __init__(self, source: Source, units: Iterable[tuple[WorkUnit, Claim]], family, job: JobConfig,
                 text: TextSide):
        self.source, self.units, self.family, self.job, self.text = source, units, family, job, text
        self.decoder = Decoder(job.decode, job.video)

    def __iter__(self):
        try:
            yield from self._prepared()
        finally:
            self.decoder.close()

    def _prepared(self):
        for unit, claim in self.units:
            yield UnitStart(unit, claim)
            count, seen = 0, set()
            for record in self.source.unit_records(unit):
                crash_point("decode")
                count += 1
                yield checked_id(record, unit, seen) or prepare(record, self.family, self.job, self.decoder, self.text)
            yield UnitEnd(unit, count)


class QueuedUnits:
    """A rank's claimed units handed to its DataLoader workers one at a time through a queue, by a thread of the
    main process that claims them as the queue empties: the rank claims, not each of its workers, and holds a
    block only once a worker is about to need its units. Iterated in a worker, it yields until the thread is done."""

    def __init__(self, claimed: Iterator[tuple[WorkUnit, Claim]], workers: int):
        self.claimed, self.workers = claimed, workers
        self.queue = multiprocessing.get_context().Queue(maxsize=1)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._feed, name="batchvlm-claims", daemon=True)

    def start(self) -> None:
        """After the workers have forked (a forked child would inherit the thread's locks, not the thread)."""
        self.thread.start()

    def _feed(self) -> None:
        try:
            for item in self.claimed:
                self.queue.put(item)
        except BaseException as error:  # raised in the main process once the pass ends (`check`)
            self.error = error
        finally:
            for _ in range(self.workers):
                self.queue.put(None)

    def __iter__(self) -> Iterator[tuple[WorkUnit, Claim]]:
        while (item := self.queue.get()) is not None:
            yield item

    def check(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise self.error


def _keep(item):
    return item


def rank_cores() -> int:
    """The cores this rank may use: those the process may run on, shared evenly among the node's ranks (the
    LOCAL_WORLD_SIZE that accelerate and torchrun set)."""
    return max(1, len(os.sched_getaffinity(0)) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def worker_count(configured: int | None) -> int:
    """runtime.num_workers, or where it is null one per core of the rank but the main process's."""
    return max(1, rank_cores() - 1) if configured is None else configured


def thread_cap() -> int | None:
    """OMP_NUM_THREADS where it is set: the threads a user, a launcher (torchrun and accelerate set 1) or a test
    runner gives each process."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    return int(value) if value.isdigit() and int(value) > 0 else None


@contextmanager
def main_threads(workers: int) -> Iterator[None]:
    """The main process's intra-op threads during a pass: the rank's cores its workers leave (at least one), and no
    more than OMP_NUM_THREADS allows. Its parallel ops wait for every thread they start; a thread that a busy worker
    (or another process given the core) has taken the core of holds the op for a scheduler quantum, as every small
    tensor op of the main loop would once each core runs a worker: past its cores, OpenMP's threads spin."""
    threads, cores = torch.get_num_threads(), rank_cores()
    torch.set_num_threads(max(1, min(cores - workers, thread_cap() or cores)))
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def prepared_units(source: Source, claimed: Iterator[tuple[WorkUnit, Claim]], family, job: JobConfig,
                   text: TextSide, rings: Rings | None = None) -> tuple[Iterator, QueuedUnits | None]:
    """The rank's claimed units prepared in `runtime.num_workers` DataLoader worker processes (0: inline, for
    debugging; the decoder still forks its child on first use), and the queue that feeds the workers, to be started
    once the caller has nothing more to fork. The workers' items cross in chunks (transport.py), their pixels in
    `rings` (one per worker: transport.job_rings); each worker keeps two chunks of up to `runtime.prefetch` records
    ready."""
    workers = worker_count(job.runtime.num_workers)
    if workers == 0:
        return iter(PreparedStream(source, claimed, family, job, text)), None
    queued = QueuedUnits(claimed, workers)
    if rings is not None:
        rings.restart()
    stream = ChunkedStream(PreparedStream(source, queued, family, job, text), job.preprocess.token_budget,
                           job.runtime.prefetch, rings)
    loader = iter(DataLoader(stream, batch_size=None, num_workers=workers, collate_fn=_keep, prefetch_factor=2,
                             persistent_workers=False))  # the workers fork here, before any thread of the pass starts
    return unchunked(loader, rings), queued
