"""The driver: the one loop that chains the stages. It knows stages and records, no family.

    workers (DataLoader):  claim a unit -> source -> decode -> plan -> layout   (UnitStart | PreparedRecord |
                                                                                 QuarantinedRecord | UnitEnd)
    main process:          token-budget batches -> [JPEG decode] -> preprocess -> encode -> assemble
                           (runtime.overlap: batch k+1 decoded and preprocessed on a side stream while batch k encodes)
    writer thread:         sink (atomic per-unit commit)

A failure inside a packed batch is pinned on its record: checks that know the record name it, any
other error is bisected down to the record that raises it; the rest of the batch is committed.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils.data import DataLoader, IterableDataset

from batchvlm.pipeline.assemble import data_row, quarantine_row

from batchvlm.format.schema import EMBED_DTYPES
from batchvlm.checks import CheckFailed, unexpected_failure
from batchvlm.config import JobConfig
from batchvlm.pipeline.decode import Decoder
from batchvlm.rundir.claims import Claims, Heartbeat
from batchvlm.rundir.dedup import commit_bucket, find_duplicates, result_path
from batchvlm.executor.distributed import Coordinator, init_ranks
from batchvlm.pipeline.encode import encode_batch, finish_batch, start_batch
from batchvlm.faults import crash_point
from batchvlm.families import load_family
from batchvlm.pipeline.jpeg import JpegBatchDecoder, resolve_jpeg_decode
from batchvlm.executor.overlap import Streams
from batchvlm.pipeline.preprocess import PreprocessGuard, make_preprocessor, pack, resolve_backend
from batchvlm.executor.progress import Progress
from batchvlm.records import (EncodedRecord, Failure, PackedBatch, PreparedRecord, QuarantinedRecord, SourceRecord,
                              UnitEnd, UnitStart, WorkUnit)
from batchvlm.sources.requeue import requeue_source, write_lineage
from batchvlm.rundir.run import RunDir
from batchvlm.rundir.sink import RunSink, SinkWriter
from batchvlm.sources import Source, make_source
from batchvlm.rundir.workunits import Plan, make_plan, read_plan
from batchvlm.pipeline.tokens import attach_positions, build_layout, place_images

log = logging.getLogger("batchvlm")


class JobAborted(RuntimeError):
    """The job stopped on purpose (e.g. too many records quarantined); the message says why."""


# -- worker side: decode, plan, layout ---------------------------------------------------------
def prepare(record: SourceRecord, family, job: JobConfig, decoder: Decoder) -> PreparedRecord | QuarantinedRecord:
    try:
        text = place_images(record.text, job.dataset.placeholder, len(record.images),
                            job.dataset.missing_placeholder)
        images = [decoder(ref, index) for index, ref in enumerate(record.images)]
        return plan_and_lay_out(record, text, images, family, job)
    except CheckFailed as failure:
        return QuarantinedRecord(record, failure.to_failure())


def plan_and_lay_out(record: SourceRecord, text: str, images: list, family, job: JobConfig) -> PreparedRecord:
    """The plan of each decoded image and the record's token layout (raises CheckFailed)."""
    plans = [family.plan(image.height, image.width) for image in images]
    layout = build_layout(text, job.dataset.placeholder, plans, family)
    attach_positions(layout, plans, family)
    return PreparedRecord(source=record, images=images, plans=plans, layout=layout)


def source_failure(record: SourceRecord, check: str, message: str) -> QuarantinedRecord:
    failure = Failure(check=check, stage="source", message=message, expected="a unique, non-empty id",
                      observed=repr(record.id), exception_type="CheckFailed")
    return QuarantinedRecord(record, failure)


class PreparedStream(IterableDataset):
    """Each worker claims units one at a time (claims.py) and yields, per unit it wins, the start marker,
    its records prepared, and the end marker. Units committed meanwhile are skipped."""

    def __init__(self, source: Source, units: list[WorkUnit], family, job: JobConfig, claims: Claims,
                 run_dir: Path):
        self.source, self.units, self.family, self.job = source, units, family, job
        self.claims, self.manifests = claims, run_dir / "manifest"
        self.decoder = Decoder(job.decode)

    def __iter__(self):
        try:
            yield from self._prepared()
        finally:
            self.decoder.close()

    def _committed(self, unit: WorkUnit) -> bool:
        return (self.manifests / f"{unit.unit_id}.json").exists()

    def _prepared(self):
        for unit in self.units:
            if self._committed(unit) or (claim := self.claims.try_claim(unit.unit_id)) is None:
                continue
            if self._committed(unit):  # committed by a holder that outlived its lease
                continue
            yield UnitStart(unit, claim)
            count, seen = 0, set()
            for record in self.source.records(unit):
                crash_point("decode")
                count += 1
                yield self._checked(record, unit, seen)
            yield UnitEnd(unit, count)

    def _checked(self, record: SourceRecord, unit: WorkUnit, seen: set) -> PreparedRecord | QuarantinedRecord:
        """The source checks (the row as read, its id, an id seen earlier in the unit), then prepare."""
        if record.id is None:
            record.id = f"{unit.source}#{record.row}"
            return source_failure(record, "source.missing_id", "the id column is empty for this row")
        if record.failure is not None:
            return QuarantinedRecord(record, record.failure)
        if record.id in seen:
            return source_failure(record, "source.duplicate_id", f"id {record.id!r} appeared earlier in this unit")
        seen.add(record.id)
        return prepare(record, self.family, self.job, self.decoder)


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
class Staged:
    """Batch k+1, its copies and preprocessing queued on the side stream while batch k encodes. `batch` is None
    where packing raised: the batch is then redone on the checked path, which pins the failure on its record."""

    records: list[PreparedRecord]
    batch: PackedBatch | None
    ready: object = None  # the side stream's event after this batch (None on the CPU)
    refused: list[QuarantinedRecord] = field(default_factory=list)  # records whose JPEG the safe path refused


def made_on_the_side(staged: Staged) -> list[torch.Tensor]:
    """What the compute stream reads of the side stream's work: the packed pixels, and the pixels decoded on the
    device (decode.jpeg=device), which the checked path packs again if the batch is redone."""
    decoded = [image.pixels for record in staged.records for image in record.images
               if isinstance(image.pixels, torch.Tensor)]
    return decoded + ([staged.batch.pixel_values] if staged.batch is not None else [])


@dataclass
class Device:
    preprocessor: object
    encoder: object
    guard: PreprocessGuard = field(default_factory=PreprocessGuard)
    out_dtype: torch.dtype | None = None  # the stored dtype: outputs cross to the host in it, once per batch
    streams: Streams | None = None
    """runtime.overlap: with streams, `submit` stages batch k+1 while batch k encodes; without, batch by batch."""
    jpegs: JpegBatchDecoder | None = None
    """decode.jpeg=device: decodes the JPEGs that the workers left encoded, a batch at a time, before preprocessing."""

    def submit(self, pending: Staged | None, records: list[PreparedRecord]) -> tuple[
            list[EncodedRecord], list[QuarantinedRecord], Staged | None]:
        """Hand in the next batch (empty at the end of the stream); get back the results of the batch handed in
        before it and the batch now pending. Without streams the batch is encoded at once and nothing is pending.

        Order, with streams: batch k's tower is queued, then batch k+1 is staged on the side stream (its pack reads
        its checks back with a sync of the side stream alone), then batch k's checks and copy to the host wait for
        the tower. A batch that fails anywhere on this path is redone on the checked path (`encode`), so its
        failures are pinned and bisected exactly as without overlap."""
        if self.streams is None:
            records, refused = self._decoded(records)
            encoded, quarantined = self.encode(records)
            return encoded, refused + quarantined, None
        outputs = self._launch(pending) if pending is not None else None
        staged = self._stage(records) if records else None
        if pending is None:
            return [], [], staged
        encoded, quarantined = self._finish(pending, outputs)
        return encoded, pending.refused + quarantined, staged

    def _decoded(self, records: list[PreparedRecord]) -> tuple[list[PreparedRecord], list[QuarantinedRecord]]:
        return self.jpegs(records) if self.jpegs is not None else (records, [])

    def _stage(self, records: list[PreparedRecord]) -> Staged:
        with self.streams.staging():
            records, refused = self._decoded(records)
            try:
                batch = pack(records, self.preprocessor, self.guard)
            except Exception:  # noqa: BLE001 - redone and pinned on the checked path when the batch's turn comes
                batch = None
            return Staged(records, batch, self.streams.staged(), refused)

    def _launch(self, staged: Staged) -> dict | None:
        crash_point("encode")
        self.streams.hand_over(staged.ready, made_on_the_side(staged))
        if staged.batch is None:
            return None
        try:
            return start_batch(self.encoder, staged.batch)
        except Exception:  # noqa: BLE001 - redone and pinned on the checked path
            return None

    def _finish(self, staged: Staged, outputs: dict | None) -> tuple[list[EncodedRecord], list[QuarantinedRecord]]:
        if outputs is not None:
            try:
                return finish_batch(self.encoder, staged.batch, outputs, self.out_dtype), []
            except Exception:  # noqa: BLE001 - redone and pinned on the checked path
                pass
        return self.encode(staged.records)

    def encode(self, records: list[PreparedRecord]) -> tuple[list[EncodedRecord], list[QuarantinedRecord]]:
        """The checked path: encode a batch, pin every failure on the record that caused it and encode the rest
        unchanged."""
        if not records:
            return [], []
        crash_point("encode")
        try:
            return encode_batch(self.encoder, pack(records, self.preprocessor, self.guard), self.out_dtype), []
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
    """One rank's part of the job; every rank of `accelerate launch` builds one."""

    def __init__(self, job: JobConfig, run_dir: Path):
        self.job = job
        self.ranks, self.device = init_ranks(job.model.device)
        # The fingerprint and config.yaml name the backend that runs, not `auto`: backends differ by a level.
        job.preprocess.backend = resolve_backend(job.preprocess.backend, self.device)
        job.decode.jpeg = resolve_jpeg_decode(job.decode.jpeg, self.device)
        self.family = load_family(job.model)
        self.requeue = requeue_source(job, run_dir) if job.requeue_from else None
        encoder = self.family.load_encoder(self.device, EMBED_DTYPES[job.model.dtype])
        self.embed_dtype = EMBED_DTYPES[job.output.embed_dtype]
        self.run = RunDir(run_dir, job, self.family, encoder, self.ranks)
        self.sink = RunSink(run_dir, self.run.schema_metadata(encoder.hidden_sizes), job.output.compression,
                            self.ranks.rank)
        self.hidden_sizes = encoder.hidden_sizes
        self.on_device = Device(make_preprocessor(job.preprocess.backend, self.family, self.device,
                                                  job.preprocess.background), encoder,
                                PreprocessGuard.from_config(job.preprocess, self.family, job.preprocess.background),
                                self.embed_dtype, Streams(self.device) if job.runtime.overlap else None,
                                self._jpeg_decoder())
        self.seen = 0
        self.quarantined = 0
        self.image_tokens = 0

    def _jpeg_decoder(self) -> JpegBatchDecoder | None:
        """decode.jpeg=device: the batched decoder, with the safe path (forced: it must not defer again) for the
        images it cannot decode."""
        if self.job.decode.jpeg != "device":
            return None
        return JpegBatchDecoder(self.device, Decoder(dataclasses.replace(self.job.decode, jpeg="safe")))

    def _plan(self) -> tuple[Plan, Source]:
        """Rank 0 plans from the inputs' metadata (or checks the plan of an earlier attempt) and clears what a
        crashed attempt left; the others read the plan, and list nothing."""
        if self.ranks.is_main:
            started = time.perf_counter()
            source = self.requeue or make_source(self.job.dataset)
            plan = make_plan(self.run.path, source, self.job.dataset, self.job.runtime.dedup_buckets)
            log.info("plan: %d work units from %d inputs in %.2f s", len(plan.units), len(plan.inputs),
                     time.perf_counter() - started)
            if self.requeue is not None:
                write_lineage(self.run.path, self.requeue)
            removed = self.sink.remove_orphans()
            if removed:
                log.info("removed %d files of an earlier attempt that no manifest lists", len(removed))
        self.coordinator = Coordinator(self.run.path, self.ranks)  # a barrier: the plan exists after it
        plan = read_plan(self.run.path)
        if not self.ranks.is_main:
            source = self.requeue or make_source(self.job.dataset, plan.inputs)
        self.sink.dedup_buckets = plan.dedup_buckets
        return plan, source

    def run_all(self) -> dict | None:
        """Embed until every unit is committed, then find duplicates; rank 0 returns the summary."""
        started = time.perf_counter()
        if (done := self.run.completed()) is not None:
            log.info("%s is already complete: nothing to do", self.run.path)
            return done
        plan, source = self._plan()
        claims = self.coordinator.claims(self.job.runtime.lease_s)
        self.sink.claims = claims
        heartbeat = Heartbeat(claims)
        try:
            self._embed(plan, source, claims)
            self._find_duplicates(plan, claims)
        finally:
            heartbeat.stop()
        self.coordinator.done({"rank": self.ranks.rank, "records": self.seen, "image_tokens": self.image_tokens})
        if not self.ranks.is_main:
            return None
        self.sink.remove_orphans()  # files of ranks that died or lost a unit: no manifest lists them
        stats = self.coordinator.rank_stats(claims, self.job.runtime.poll_s)
        return self.run.finish(plan, time.perf_counter() - started, sum(s["records"] for s in stats),
                               sum(s["image_tokens"] for s in stats))

    def _embed(self, plan: Plan, source: Source, claims: Claims) -> None:
        """Claim and embed units until every unit of the plan is committed (by any rank)."""
        committed = self.sink.committed()
        log.info("rank %d/%d: %d work units in the run, %d committed", self.ranks.rank, self.ranks.world,
                 len(plan.units), len(committed))
        todo = [unit for unit in plan.claim_order() if unit.unit_id not in committed]
        progress = Progress(sum(unit.num_rows or 0 for unit in todo) or None, f"embed {self.run.path.name}",
                            self.job.runtime.progress and self.ranks.is_main, self.job.runtime.progress_interval_s)
        try:
            while todo:
                if any(claims.claimable(unit.unit_id) for unit in todo):
                    self._embed_claimed(source, todo, claims, progress)
                else:  # every unit left is held by a live rank: look again (one may die)
                    self._show(progress)
                    time.sleep(self.job.runtime.poll_s)
                committed = self.sink.committed()
                todo = [unit for unit in todo if unit.unit_id not in committed]
            self._show(progress)
        finally:
            progress.close()

    def _embed_claimed(self, source: Source, todo: list[WorkUnit], claims: Claims, progress) -> None:
        stream = self._stream(source, todo, claims)  # workers fork before the writer thread exists
        writer = SinkWriter(self.sink, self.job.runtime.writer_queue)
        batcher = TokenBudgetBatcher(self.job.preprocess.token_budget, self.job.preprocess.max_images_per_batch)
        pending = None  # the batch staged while the one before it encodes (runtime.overlap)
        try:
            for item in stream:
                if isinstance(item, UnitStart):
                    writer.submit(lambda item=item: self.sink.start_unit(item.unit, item.claim))
                elif isinstance(item, UnitEnd):
                    writer.submit(lambda item=item: self.sink.end_unit(item.unit, item.num_records))
                elif isinstance(item, QuarantinedRecord):
                    self._emit(writer, progress, [], [item])
                elif not item.plans:
                    self._emit(writer, progress, [EncodedRecord(item, [])], [])
                elif (batch := batcher.add(item)) is not None:
                    pending = self._submit(writer, progress, pending, batch)
            pending = self._submit(writer, progress, pending, batcher.flush())
            self._submit(writer, progress, pending, [])  # the last batch staged is encoded too
            writer.close()
        finally:
            writer.close()
            self.sink.abandon_open_units()
            if self.on_device.jpegs is not None:
                self.on_device.jpegs.close()  # its safe path's child; started again on the next use

    def _submit(self, writer: SinkWriter, progress, pending: Staged | None,
                batch: list[PreparedRecord]) -> Staged | None:
        encoded, quarantined, pending = self.on_device.submit(pending, batch)
        self._emit(writer, progress, encoded, quarantined)
        return pending

    def _find_duplicates(self, plan: Plan, claims: Claims) -> None:
        """Ranks claim the hash partitions of the ids one at a time and list the later occurrences of each id."""
        locations = {item.name: item.location for item in plan.inputs}
        manifests = None
        while missing := [b for b in range(plan.dedup_buckets) if not result_path(self.run.path, b).exists()]:
            claim = next((c for bucket in missing if (c := claims.try_claim(f"dedup-{bucket:05d}"))), None)
            if claim is None:  # the rest are held by live ranks: wait for them (or for their leases to expire)
                time.sleep(self.job.runtime.poll_s)
                continue
            if manifests is None:  # in plan order: the first occurrence is the one kept
                manifests = plan.manifests(self.run.path)
            bucket = int(claim.task.rsplit("-", 1)[1])
            duplicates = find_duplicates(self.run.path, manifests, bucket, locations)
            if claims.holds(claim):
                commit_bucket(self.run.path, bucket, duplicates)

    def _show(self, progress) -> None:
        """Rank 0's progress counts every rank's records, read from their progress files."""
        if self.ranks.is_main:
            progress.show(self.coordinator.records_done())

    def _stream(self, source: Source, todo: list[WorkUnit], claims: Claims):
        dataset = PreparedStream(source, todo, self.family, self.job, claims, self.run.path)
        workers = min(self.job.runtime.num_workers, len(todo))
        if workers == 0:
            return iter(dataset)  # inline: the decoder still forks its child on first use
        return iter(DataLoader(dataset, batch_size=None, num_workers=workers, collate_fn=_keep,
                               prefetch_factor=self.job.runtime.prefetch, persistent_workers=False))

    def _emit(self, writer: SinkWriter, progress, encoded: list[EncodedRecord],
              quarantined: list[QuarantinedRecord]) -> None:
        rows, quarantined = [], list(quarantined)
        for item in encoded:
            try:
                rows.append((item.prepared.source, data_row(item, self.embed_dtype, self.hidden_sizes)))
            except CheckFailed as failure:
                quarantined.append(QuarantinedRecord(item.prepared.source, failure.to_failure()))
        guard = self.on_device.guard
        for record, row in rows:
            events = guard.take(row["id"])
            writer.submit(lambda record=record, row=row, events=events:
                          self.sink.add(record.unit_id, record.seq, "data", row, events))
        for item in quarantined:
            log.warning("quarantined %s [%s] %s", item.source.id, item.failure.check, item.failure.message)
            events = guard.take(item.source.id)
            row = quarantine_row(item, self.job.output.quarantine_bytes_cap, self.run.fingerprint_digest)
            writer.submit(lambda record=item.source, row=row, events=events:
                          self.sink.add(record.unit_id, record.seq, "quarantine", row, events))
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

