"""The job: one rank's part of it, as a plain chain of steps. It knows stages and records, no family.

    build:     the device, the family and its tower, the run directory, the device stage       (build)
    plan:      rank 0 plans the units from the inputs' metadata; every rank reads the plan     (Job.plan)
    embed:     until every unit is committed, by any rank:                                     (Job.embed)
                 claims thread: claim a block of units at the frontier (rundir.frontier)          (executor.worker)
                 workers:       a claimed unit -> source -> decode -> plan -> layout           (executor.worker)
                 main process:  the typed steps: token-budget batches -> device -> rows -> sink (executor.steps)
                 writer thread: sink (atomic per-unit commit)                                  (rundir.sink)
               then wait on the launch's board for blocks that dead holders left, or the end
    dedup:     ranks claim the hash buckets of the ids and list the later occurrences          (Job.find_duplicates)
    finish:    rank 0 writes the run's totals once every rank is done                          (rundir.run)
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import OmegaConf

from batchvlm.executor.config import JobConfig
from batchvlm.executor.batching import TokenBudgetBatcher
from batchvlm.executor.device import Device
from batchvlm.executor.distributed import Coordinator, Ranks, init_ranks
from batchvlm.executor.fingerprint import run_fingerprint
from batchvlm.executor.overlap import Streams
from batchvlm.executor.progress import Progress
from batchvlm.executor.rows import Assembler
from batchvlm.executor.steps import job_steps
from batchvlm.executor.tally import JobAborted, QuarantineOverLimit, Tally, check_run_totals
from batchvlm.executor.transport import Rings, job_rings
from batchvlm.executor.worker import main_threads, prepared_units, text_side_of, worker_count
from batchvlm.families import Family, load_family, resolve_checkpoint
from batchvlm.towers.attention import resolve_attention
from batchvlm.format.schema import EMBED_DTYPES, shard_metadata
from batchvlm.pipeline.decode import Decoder
from batchvlm.pipeline.jpeg import JpegBatchDecoder, resolve_jpeg_decode
from batchvlm.pipeline.preprocess import PreprocessGuard, make_preprocessor, resolve_backend
from batchvlm.pipeline.text import TextSide
from batchvlm.records import WorkUnit
from batchvlm.rundir.claims import Claim, Claims, Heartbeat
from batchvlm.rundir.dedup import BucketPass
from batchvlm.rundir.layout import DATA, QUARANTINE, RunLayout
from batchvlm.rundir.cleanup import remove_stale, uncommit_broken
from batchvlm.rundir.manifest import committed_units
from batchvlm.rundir.rank_reports import RankUnits
from batchvlm.rundir.run import RunDir, check_ours
from batchvlm.rundir.sink import RunSink, SinkWriter
from batchvlm.rundir.frontier import Backoff, buckets_phase, claimed_units, units_phase
from batchvlm.rundir.workunits import Plan, make_plan, read_plan, write_plan
from batchvlm.sources import Source, make_source
from batchvlm.sources.requeue import RequeueSource, requeue_source, write_lineage

__all__ = ["JobAborted", "QuarantineOverLimit", "Terminated", "run_job", "summarize"]

log = logging.getLogger("batchvlm")


class Terminated(BaseException):
    """The process was asked to stop (SIGTERM). A BaseException, so that no stage takes it for a record's failure."""


def resolve_auto(job: JobConfig, device: torch.device) -> JobConfig:
    """The config with its `auto` choices made for the device the job runs on: the fingerprint and config.yaml name
    what runs (the backends' pixels differ by a level, nvJPEG's are not libjpeg-turbo's)."""
    attention = resolve_attention(job.model.attn_implementation, device, EMBED_DTYPES[job.model.dtype])
    return dataclasses.replace(
        job, preprocess=dataclasses.replace(job.preprocess, backend=resolve_backend(job.preprocess.backend, device)),
        decode=dataclasses.replace(job.decode, jpeg=resolve_jpeg_decode(job.decode.jpeg, device)),
        model=dataclasses.replace(job.model, attn_implementation=attention))


@dataclass
class Draft:
    """Rank 0's plan, made (or read back and checked) before the run directory is written."""

    plan: Plan
    source: Source
    new: bool


@dataclass
class Parts:
    """What a rank runs the job with, all built before any unit is claimed."""

    job: JobConfig
    ranks: Ranks
    device: torch.device
    layout: RunLayout
    family: Family
    run: RunDir
    stage: Device
    assembler: Assembler
    requeue: RequeueSource | None
    text: TextSide  # the text side of the dataset's format: plain text, or conversations and their chat template
    draft: Draft | None  # rank 0's
    rings: Rings | None  # the workers' pixel rings (executor.transport), page-locked once on CUDA

    def shard_metadata(self) -> dict[str, str]:
        """What every shard of the run says of itself in its schema metadata."""
        return shard_metadata(self.family.name, self.assembler.hidden_sizes, self.job.output.embed_dtype,
                              self.job.model.embedding, self.run.fingerprint_digest)


def build(job: JobConfig, layout: RunLayout, ranks: Ranks, device: torch.device) -> Parts:
    """The family and its tower, rank 0's plan, the run directory (its fingerprint checked), the device stage.

    The plan comes before the run directory is written: a config that does not fit its inputs (a column that is not
    there, a glob that matches nothing, a changed input) is refused with nothing left behind."""
    family = load_family(job.model)
    text = text_side_of(family, job)
    # the checkpoint's strict check (every vision tensor by name and shape) before the inputs are listed: a wrong
    # checkpoint is refused in seconds, whatever the inputs cost to plan
    encoder = family.load_encoder(device, EMBED_DTYPES[job.model.dtype])
    requeue = requeue_source(job.dataset, job.requeue_from, job.check, layout.root) if job.requeue_from else None
    draft = None
    if ranks.is_main:
        source = requeue or make_source(job.dataset, max_bytes=job.decode.max_bytes, clip_max_bytes=job.video.max_bytes)
        plan, new = make_plan(layout, source, job.reading_settings(), ranks.world, job.runtime.dedup_buckets,
                              job.runtime.block_units)
        draft = Draft(plan, source, new)
    run = RunDir(layout, run_fingerprint(job, family, encoder), OmegaConf.to_yaml(OmegaConf.structured(job)), ranks)
    embed_dtype = EMBED_DTYPES[job.output.embed_dtype]
    overlap = job.runtime.overlap
    stage = Device(make_preprocessor(job.preprocess.backend, family, device, job.preprocess.background), encoder,
                   PreprocessGuard.from_config(job.preprocess, family, job.preprocess.background), embed_dtype,
                   overlap, Streams(device, overlap), _jpeg_decoder(job, device))
    assembler = Assembler(embed_dtype, encoder.hidden_sizes, job.output.quarantine_bytes_cap, run.fingerprint_digest,
                          job.text.trained(job.dataset.format), job.dataset.placeholder)
    return Parts(job, ranks, device, layout, family, run, stage, assembler, requeue, text, draft,
                 job_rings(worker_count(job.runtime.num_workers), device))


def _jpeg_decoder(job: JobConfig, device: torch.device) -> JpegBatchDecoder | None:
    """decode.jpeg=device: the batched decoder, with the safe path (forced: it must not defer again) for the
    images it cannot decode."""
    if job.decode.jpeg != "device":
        return None
    return JpegBatchDecoder(device, Decoder(dataclasses.replace(job.decode, jpeg="safe")))


class Job:
    """One rank's part of the job; every rank of `accelerate launch` runs one."""

    def __init__(self, parts: Parts):
        self.parts, self.job, self.layout, self.ranks = parts, parts.job, parts.layout, parts.ranks
        self.tally = Tally(parts.job.checks)
        self.units = RankUnits()  # this rank's units, as it reports them (rundir.rank_reports)

    def run_all(self) -> dict | None:
        """Embed until every unit is committed, then find duplicates; rank 0 returns the summary. A process that
        finds the run complete (from the start, or finished meanwhile by another job) ends without error."""
        if (done := self.parts.run.completed()) is not None:
            log.info("%s is already complete: nothing to do", self.layout.root)
            return done if self.ranks.is_main else None
        try:
            return self._run()
        except Exception:
            if (done := self.parts.run.completed()) is None:
                raise
            log.info("%s was completed meanwhile by another job", self.layout.root)
            return done if self.ranks.is_main else None

    def _run(self) -> dict | None:
        started = time.perf_counter()
        plan, source, coordinator = self.plan()
        claims = coordinator.claims(self.job.runtime.lease_s)
        heartbeat = Heartbeat(claims)
        try:
            if self.ranks.is_main:
                self.tidy(plan, claims)
            self.ranks.barrier()  # units whose commit was withdrawn are claimable before any rank looks
            sink = RunSink(self.layout, self.parts.shard_metadata(),
                           self.job.output.compression, claims, plan.dedup_buckets, self.ranks.rank,
                           self.job.output.shard_bytes, self.units)
            self.embed(plan, source, claims, sink, coordinator)
            self.find_duplicates(plan, claims, coordinator)
        finally:
            heartbeat.stop()
        tally = self.tally
        coordinator.done({"rank": self.ranks.rank, "records": tally.seen, "image_tokens": tally.image_tokens})
        if not self.ranks.is_main:
            return None
        stats = coordinator.rank_stats(claims, self.job.runtime.poll_s)
        self.tidy(plan, claims)  # what dead holders left, and a unit damaged meanwhile, before the totals
        summary = self.parts.run.finish(plan, time.perf_counter() - started, sum(s["records"] for s in stats),
                                        sum(s["image_tokens"] for s in stats))
        if summary["complete"]:
            coordinator.retire(claims)
        return summary

    def tidy(self, plan: Plan, claims: Claims) -> None:
        """Rank 0: units that are not whole are uncommitted (and redone), and what dead claims left is removed."""
        uncommit_broken(self.layout)
        if removed := remove_stale(self.layout, plan.block_of(), claims):
            log.info("removed %d files that dead claims left and no manifest lists", len(removed))

    def plan(self) -> tuple[Plan, Source, Coordinator]:
        """Rank 0 writes the plan it made from the inputs' metadata (or checked against an earlier attempt's); the
        others read it, and list nothing."""
        requeue, draft = self.parts.requeue, self.parts.draft
        if self.ranks.is_main:
            if draft.new:
                write_plan(self.layout, draft.plan)
            log.info("plan: %d work units from %d inputs", len(draft.plan.units), len(draft.plan.inputs))
            if requeue is not None:
                write_lineage(self.layout, requeue)
        # a collective: the plan exists after it
        coordinator = Coordinator(self.layout, self.ranks, self.job.runtime.progress_interval_s, self.units)
        plan = read_plan(self.layout)
        source = draft.source if self.ranks.is_main else requeue or make_source(
            self.job.dataset, plan.inputs, self.job.decode.max_bytes, self.job.video.max_bytes)
        return plan, source, coordinator

    def embed(self, plan: Plan, source: Source, claims: Claims, sink: RunSink, coordinator: Coordinator) -> None:
        """Claim blocks of units and embed them until every unit of the plan is committed (by any rank)."""
        progress = Progress(self._rows_left(plan), f"embed {self.layout.root.name}",
                            self.job.runtime.progress and self.ranks.is_main, self.job.runtime.progress_interval_s)
        shown = lambda: self._show(progress, coordinator)  # noqa: E731
        phase = units_phase(self.layout, plan, claims, coordinator.attempt, self.ranks.is_main, self._backoff())
        blocks = plan.blocks_by_task()
        log.info("rank %d/%d: %d work units in the run, in %d blocks of up to %d", self.ranks.rank, self.ranks.world,
                 len(plan.units), len(blocks), plan.block_units)

        def wait(seconds: float) -> None:  # the tail: progress shown while the rank waits
            shown()
            time.sleep(seconds)

        def work(claimed: Iterator[Claim]) -> None:
            self.embed_claimed(source, claimed_units(self.layout, blocks, claimed, self.units), sink, shown)

        try:
            shown()  # a report before the first unit: batchvlm-status sees the rank from its start
            phase.work_through(work, wait)
            shown()
        finally:
            progress.close()

    def _rows_left(self, plan: Plan) -> int | None:
        """Rank 0 (the one that shows progress): the rows of the units not committed yet, from one listing."""
        if not self.ranks.is_main:
            return None
        committed = committed_units(self.layout)
        log.info("%d work units committed before this launch", len(committed))
        if plan.from_pattern:
            return None  # no unit knows its rows before it is read
        return sum(unit.num_rows or 0 for unit in plan.units if unit.unit_id not in committed) or None

    def _backoff(self) -> Backoff:
        return Backoff.of_tail(self.job.runtime.poll_s, self.job.runtime.lease_s)

    def embed_claimed(self, source: Source, claimed: Iterator[tuple[WorkUnit, Claim]], sink: RunSink, shown) -> None:
        """One pass over the units this rank claims until there is nothing more to claim for now: the chain from
        claimed units to committed shards."""
        runtime, parts = self.job.runtime, self.parts
        # the workers fork before any thread of this pass starts
        prepared, queued = prepared_units(source, claimed, parts.family, self.job, parts.text, parts.rings)
        writer = SinkWriter(sink, runtime.writer_queue)
        batcher = TokenBudgetBatcher(self.job.preprocess.token_budget, self.job.preprocess.max_images_per_batch)
        if queued is not None:
            queued.start()
        try:
            with main_threads(worker_count(runtime.num_workers)):
                job_steps(parts.stage, parts.assembler, batcher, writer, self.tally, shown).run(prepared)
            writer.close()
            if queued is not None:
                queued.check()
        finally:
            writer.close()
            sink.abandon_open_units()
            if parts.stage.jpegs is not None:
                parts.stage.jpegs.close()  # its safe path's child; started again on the next use

    def find_duplicates(self, plan: Plan, claims: Claims, coordinator: Coordinator) -> None:
        """Ranks claim the hash partitions of the ids and list the later occurrences of each id."""
        locations = plan.locations()
        phase = buckets_phase(self.layout, plan.dedup_buckets, claims, coordinator.attempt, self.ranks.is_main,
                              self._backoff())
        phase.work_through(BucketPass(self.layout, locations, claims))

    def _show(self, progress: Progress, coordinator: Coordinator) -> None:
        """This rank's count for the others; on rank 0, progress over every rank's count."""
        coordinator.report(self.tally.seen)
        if self.ranks.is_main:
            progress.show(coordinator.records_done(self.tally.seen))


def rank_job(job: JobConfig, run_dir: Path) -> Job:
    """This process's Job: its rank joined, `auto` resolved for its device, every part built."""
    ranks, device = init_ranks(job.model.device)
    layout = RunLayout(run_dir)
    try:
        if ranks.is_main:
            check_ours(layout)
            # a tiny checkpoint is built by rank 0 alone: transformers writes a model's weights on rank 0 only
            resolve_checkpoint(job.model)
        ranks.barrier()
        return Job(build(resolve_auto(job, device), layout, ranks, device))
    except BaseException:
        ranks.close()
        raise


def run_job(job: JobConfig, run_dir: Path) -> dict | None:
    """Rank 0's summary of the run (None on the other ranks); QuarantineOverLimit where the run, complete, quarantined
    more than checks.max_quarantine_fraction of its records, however few."""
    runner = rank_job(job, run_dir)
    try:
        summary = runner.run_all()
    finally:
        runner.ranks.close()
    if summary is not None:
        check_run_totals(summary, job.checks)
    return summary


def summarize(summary: dict) -> str:
    layout = RunLayout(Path(summary["run_dir"]))
    lines = [f"run directory: {summary['run_dir']}"]
    if summary.get("checkpoint") == "tiny":
        lines.append(f"model: {summary['family']} on its tiny demo checkpoint, not a real model (model.path=tiny)")
    lines.append(f"records in: {summary['records_in']}  written: {summary['written']}  "
                 f"quarantined: {summary['quarantined']}")
    for check, count in sorted(summary["by_check"].items(), key=lambda kv: -kv[1]):
        lines.append(f"  {check}: {count}")
    lines.append(f"throughput: {summary['records_per_s']:.1f} records/s, {summary['tokens_per_s']:.0f} image tokens/s "
                 f"over {summary['seconds']:.1f} s")
    lines.append(f"data: {layout.folder(DATA)}  quarantine: {layout.folder(QUARANTINE)}")
    for check, count in sorted(summary.get("fallbacks", {}).items()):
        lines.append(f"  redone on the CPU path after {check}: {count}")
    if not summary["complete"]:
        lines.append("NOT COMPLETE: some units are not committed; rerun the same command to finish")
    return "\n".join(lines)
