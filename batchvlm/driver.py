"""The driver: the one loop that chains the stages. It knows stages and records, no family.

    workers (DataLoader):  source -> decode -> plan -> layout      (PreparedRecord | QuarantinedRecord | UnitEnd)
    main process:          token-budget batches -> preprocess -> encode -> assemble
    writer thread:         sink (atomic per-unit commit)

A failure inside a packed batch is pinned on its record: checks that know the record name it, any
other error is bisected down to the record that raises it; the rest of the batch is committed.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from batchvlm.assemble import EMBED_DTYPES, data_row, quarantine_row
from batchvlm.checks import CheckFailed, unexpected_failure
from batchvlm.config import JobConfig
from batchvlm.decode import Decoder
from batchvlm.distributed import Coordinator, init_ranks
from batchvlm.encode import encode_batch
from batchvlm.faults import crash_point
from batchvlm.families import load_family
from batchvlm.preprocess import PreprocessGuard, make_preprocessor, pack, resolve_backend
from batchvlm.progress import Progress
from batchvlm.records import (EncodedRecord, Failure, PreparedRecord, QuarantinedRecord, SourceRecord, UnitEnd,
                              WorkUnit)
from batchvlm.requeue import RequeueSource, requeue_source, write_lineage
from batchvlm.rundir import RunDir
from batchvlm.sink import RunSink, SinkWriter
from batchvlm.source import Source
from batchvlm.workunits import assign, plan_units, read_plan
from batchvlm.tokens import attach_positions, build_layout, place_images

log = logging.getLogger("batchvlm")


class JobAborted(RuntimeError):
    """The job stopped on purpose (e.g. too many records quarantined); the message says why."""


# -- worker side: decode, plan, layout ---------------------------------------------------------
def prepare(record: SourceRecord, family, job: JobConfig, decoder: Decoder) -> PreparedRecord | QuarantinedRecord:
    try:
        text = place_images(record.text, job.dataset.placeholder, len(record.images),
                            job.dataset.missing_placeholder)
        images = [decoder(ref, index) for index, ref in enumerate(record.images)]
        plans = [family.plan(image.height, image.width) for image in images]
        layout = build_layout(text, job.dataset.placeholder, plans, family)
        attach_positions(layout, plans, family)
    except CheckFailed as failure:
        return QuarantinedRecord(record, failure.to_failure())
    return PreparedRecord(source=record, images=images, plans=plans, layout=layout)


def source_failure(record: SourceRecord, check: str, message: str) -> QuarantinedRecord:
    failure = Failure(check=check, stage="source", message=message, expected="a unique, non-empty id",
                      observed=repr(record.id), exception_type="CheckFailed")
    return QuarantinedRecord(record, failure)


class PreparedStream(IterableDataset):
    """Each worker takes every n-th unit and yields its records prepared, then the unit's end marker."""

    def __init__(self, source: Source, units: list[WorkUnit], family, job: JobConfig):
        self.source, self.units, self.family, self.job = source, units, family, job
        self.decoder = Decoder(job.decode)

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        try:
            yield from self._prepared(self.units[worker::workers])
        finally:
            self.decoder.close()

    def _prepared(self, units: list[WorkUnit]):
        for unit in units:
            count = 0
            for record in self.source.records(unit):
                crash_point("decode")
                count += 1
                if record.id is None:
                    record.id = f"{unit.source}#{record.row}"
                    yield source_failure(record, "source.missing_id", "the id column is empty for this row")
                elif self.source.is_duplicate(unit, record.row):
                    yield source_failure(record, "source.duplicate_id", f"id {record.id!r} appeared earlier")
                else:
                    yield prepare(record, self.family, self.job, self.decoder)
            yield UnitEnd(unit, count)


def _keep(item):
    return item


# -- main side: batches, encode, pin failures --------------------------------------------------
class TokenBudgetBatcher:
    """Groups records until the next one would push the batch past the patch budget."""

    def __init__(self, token_budget: int, max_images: int):
        self.token_budget, self.max_images = token_budget, max_images
        self.records: list[PreparedRecord] = []
        self.patches = 0
        self.images = 0

    def add(self, record: PreparedRecord) -> list[PreparedRecord] | None:
        """Add a record; return the batch it closes, if any."""
        full = self.records and (self.patches + record.num_patches > self.token_budget
                                 or self.images + len(record.plans) > self.max_images)
        closed = self.flush() if full else None
        self.records.append(record)
        self.patches += record.num_patches
        self.images += len(record.plans)
        return closed

    def flush(self) -> list[PreparedRecord]:
        batch, self.records, self.patches, self.images = self.records, [], 0, 0
        return batch


@dataclass
class Device:
    preprocessor: object
    encoder: object
    guard: PreprocessGuard = field(default_factory=PreprocessGuard)

    def encode(self, records: list[PreparedRecord]) -> tuple[list[EncodedRecord], list[QuarantinedRecord]]:
        """Encode a batch; pin every failure on the record that caused it and encode the rest unchanged."""
        if not records:
            return [], []
        crash_point("encode")
        try:
            return encode_batch(self.encoder, pack(records, self.preprocessor, self.guard)), []
        except CheckFailed as failure:
            if failure.record is not None:
                rest = [record for record in records if record is not failure.record]
                encoded, quarantined = self.encode(rest)
                return encoded, [QuarantinedRecord(failure.record.source, failure.to_failure())] + quarantined
            error = failure
        except Exception as caught:  # an exception or out-of-memory: find the record that raises it
            error = caught
        if len(records) == 1:
            failure = error.to_failure() if isinstance(error, CheckFailed) else unexpected_failure("encode.failed", error)
            return [], [QuarantinedRecord(records[0].source, failure)]
        middle = len(records) // 2
        left, right = self.encode(records[:middle]), self.encode(records[middle:])
        return left[0] + right[0], left[1] + right[1]


class Job:
    """One rank's share of the job; every rank of `accelerate launch` builds one."""

    def __init__(self, job: JobConfig, run_dir: Path):
        self.job = job
        self.ranks, self.device = init_ranks(job.model.device)
        # The fingerprint and config.yaml name the backend that runs, not `auto`: backends differ by a level.
        job.preprocess.backend = resolve_backend(job.preprocess.backend, self.device)
        self.family = load_family(job.model)
        self.source = requeue_source(job, run_dir) if job.requeue_from else Source(job.dataset)
        encoder = self.family.load_encoder(self.device, EMBED_DTYPES[job.model.dtype])
        self.embed_dtype = EMBED_DTYPES[job.output.embed_dtype]
        self.run = RunDir(run_dir, job, self.family, encoder, self.ranks)
        self.sink = RunSink(run_dir, self.run.schema_metadata(encoder.hidden_sizes), job.output.compression,
                            self.ranks.rank)
        self.hidden_sizes = encoder.hidden_sizes
        self.on_device = Device(make_preprocessor(job.preprocess.backend, self.family, self.device,
                                                  job.preprocess.background), encoder,
                                PreprocessGuard.from_config(job.preprocess, self.family, job.preprocess.background))
        self.seen = 0
        self.quarantined = 0
        self.image_tokens = 0

    def _plan(self) -> list[dict]:
        """Rank 0 fixes the unit plan and clears what a crashed attempt left; the others wait for it."""
        if self.ranks.is_main:
            plan_units(self.run.path / "units.json", self.source, self.family, self.job.decode)
            if isinstance(self.source, RequeueSource):
                write_lineage(self.run.path, self.source)
            removed = self.sink.remove_orphans()
            if removed:
                log.info("removed %d files of an earlier attempt that no manifest lists", len(removed))
        self.coordinator = Coordinator(self.run.path, self.ranks)  # a barrier: the plan exists after it
        return read_plan(self.run.path / "units.json")

    def run_all(self) -> dict | None:
        """Run this rank's share; rank 0 returns the job's summary, the other ranks None."""
        started = time.perf_counter()
        if (done := self.run.completed()) is not None:
            log.info("%s is already complete: nothing to do", self.run.path)
            return done
        plan = self._plan()
        committed = self.sink.committed()
        share = assign(plan, self.ranks.world)[self.ranks.rank]
        todo = [unit for unit in share if unit.unit_id not in committed]
        log.info("rank %d/%d: %d work units in the run, %d in this rank's share, %d to do", self.ranks.rank,
                 self.ranks.world, len(plan), len(share), len(todo))
        stream = self._stream(todo)  # workers fork before the writer thread exists
        writer = SinkWriter(self.sink, self.job.runtime.writer_queue)
        batcher = TokenBudgetBatcher(self.job.preprocess.token_budget, self.job.preprocess.max_images_per_batch)
        remaining = sum(e["stop"] - e["start"] for e in plan if e["unit_id"] not in committed)
        progress = Progress(remaining, f"embed {self.run.path.name}", self.job.runtime.progress and self.ranks.is_main,
                            self.job.runtime.progress_interval_s)
        units_by_id = {unit.unit_id: unit for unit in todo}
        try:
            for item in stream:
                if isinstance(item, UnitEnd):
                    writer.submit(lambda item=item: self.sink.end_unit(item.unit, item.num_records))
                elif isinstance(item, QuarantinedRecord):
                    self._emit(writer, progress, units_by_id, [], [item])
                elif not item.plans:
                    self._emit(writer, progress, units_by_id, [EncodedRecord(item, [])], [])
                elif (batch := batcher.add(item)) is not None:
                    self._emit(writer, progress, units_by_id, *self.on_device.encode(batch))
            self._emit(writer, progress, units_by_id, *self.on_device.encode(batcher.flush()))
            writer.close()
            self.coordinator.done({"rank": self.ranks.rank, "records": self.seen, "image_tokens": self.image_tokens})
            if not self.ranks.is_main:
                return None
            stats = self.coordinator.wait_for_all(on_tick=lambda: self._show(progress))
            self._show(progress)
        finally:
            progress.close()
            writer.close()
        return self.run.finish([entry["unit_id"] for entry in plan], time.perf_counter() - started,
                               sum(s["records"] for s in stats), sum(s["image_tokens"] for s in stats))

    def _show(self, progress) -> None:
        """Rank 0's progress counts every rank's records, read from their progress files."""
        if self.ranks.is_main:
            progress.show(self.coordinator.records_done())

    def _stream(self, todo: list[WorkUnit]):
        dataset = PreparedStream(self.source, todo, self.family, self.job)
        workers = min(self.job.runtime.num_workers, len(todo))
        if workers == 0:
            return iter(dataset)  # inline: the decoder still forks its child on first use
        return iter(DataLoader(dataset, batch_size=None, num_workers=workers, collate_fn=_keep,
                               prefetch_factor=self.job.runtime.prefetch, persistent_workers=False))

    def _emit(self, writer: SinkWriter, progress, units: dict, encoded: list[EncodedRecord],
              quarantined: list[QuarantinedRecord]) -> None:
        rows, quarantined = [], list(quarantined)
        for item in encoded:
            try:
                rows.append((item.prepared.source.unit_id, data_row(item, self.embed_dtype, self.hidden_sizes)))
            except CheckFailed as failure:
                quarantined.append(QuarantinedRecord(item.prepared.source, failure.to_failure()))
        guard = self.on_device.guard
        for unit_id, row in rows:
            unit, events = units[unit_id], guard.take(row["id"])
            writer.submit(lambda unit=unit, row=row, events=events: self.sink.add_row(unit, row, events))
        for item in quarantined:
            log.warning("quarantined %s [%s] %s", item.source.id, item.failure.check, item.failure.message)
            unit, events = units[item.source.unit_id], guard.take(item.source.id)
            row = quarantine_row(item, self.job.output.quarantine_bytes_cap, self.run.fingerprint_digest)
            writer.submit(lambda unit=unit, row=row, events=events: self.sink.add_quarantine(unit, row, events))
        self.image_tokens += sum(row["num_image_tokens"] for _, row in rows)
        self.seen += len(rows) + len(quarantined)
        self.quarantined += len(quarantined)
        self.coordinator.report(self.seen)
        self._show(progress)
        self._check_quarantine_fraction()

    def _check_quarantine_fraction(self) -> None:
        limit = self.job.checks.max_quarantine_fraction
        if self.seen >= self.job.checks.min_records and self.quarantined > limit * self.seen:
            raise JobAborted(f"{self.quarantined} of {self.seen} records quarantined "
                             f"({self.quarantined / self.seen:.1%}), over checks.max_quarantine_fraction={limit}; "
                             "committed units are kept, see quarantine/ for the reasons")


def run_job(job: JobConfig, run_dir: Path) -> dict | None:
    runner = Job(job, run_dir)
    try:
        return runner.run_all()
    finally:
        runner.ranks.close()


def summarize(summary: dict) -> str:
    lines = [f"run directory: {summary['run_dir']}",
             f"records in: {summary['records_in']}  written: {summary['written']}  "
             f"quarantined: {summary['quarantined']}"]
    for check, count in sorted(summary["by_check"].items(), key=lambda kv: -kv[1]):
        lines.append(f"  {check}: {count}")
    lines.append(f"throughput: {summary['records_per_s']:.1f} records/s, {summary['tokens_per_s']:.0f} image tokens/s "
                 f"over {summary['seconds']:.1f} s")
    lines.append(f"data: {summary['run_dir']}/data  quarantine: {summary['run_dir']}/quarantine")
    for check, count in sorted(summary.get("fallbacks", {}).items()):
        lines.append(f"  redone on the CPU path after {check}: {count}")
    if not summary["complete"]:
        lines.append("NOT COMPLETE: some units are not committed; rerun the same command to finish")
    return "\n".join(lines)

