"""task=claims: the file system metadata operations of claiming, waiting and the duplicate pass, per committed unit,
as the ranks grow.

Simulated ranks run the job's own code for claims, commits, the tail and the duplicate pass (rundir.frontier,
rundir.sink, rundir.dedup) against a local folder, with no embedding work: a unit's work is a sleep on a virtual
clock (`VirtualClock`, on which the ranks run as threads one at a time), so a thousand ranks over a simulated hour
take only the time of their file operations. The leases stay the job's (file modification times set by the file
system); a rank's heartbeat beats every quarter lease of virtual time, as its thread would.

Every call the code makes on the run directory through Python (os, pathlib, open) is counted, and every file pyarrow
opens by its path as a stat and an open, as strace shows pyarrow doing (`MetadataOps`): stat, open, link, unlink,
rename, utime, mkdir, and the entries of every listing (a stat of an open file, fstat, needs no lookup of a name and
is not counted).
Each is put down to what the rank was doing: claiming (the frontier, the check that a unit is not committed, the
heartbeat), fencing (a holder's check before a commit), committing (the unit's own files and manifest), the tail
(waiting on the board; rank 0's scan, with its gathering of the ids files) or the duplicate pass. The peak rate is
that of the waiting ranks together, per virtual second (rank 0's scan is one process's sequential calls).
"""

from __future__ import annotations

import builtins
import heapq
import io
import itertools
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from batchvlm.format.schema import DATA_SHARD
from batchvlm.records import InputFile, OutputRow, SourceRecord, WorkUnit
from batchvlm.rundir.claims import Claim, Claims, owner_name
from batchvlm.rundir.dedup import BucketPass
from batchvlm.rundir.layout import DATA, RunLayout
from batchvlm.rundir.manifest import committed_units
from batchvlm.rundir.sink import RunSink
from batchvlm.rundir.frontier import Backoff, buckets_phase, claimed_units, units_phase
from batchvlm.rundir.workunits import Plan, block_units_for, write_plan

UNIT_S = 33.0
"""Virtual seconds a rank takes for a unit: 10,000 records at 300 images/s."""
START_S = 60.0
"""Ranks start within this many virtual seconds of each other (model loading)."""
POLL_S, LEASE_S = 2.0, 120.0
"""runtime.poll_s and runtime.lease_s, the job's defaults."""
THREAD_STACK = 1 << 20
"""Bytes of stack a simulated rank's thread reserves (thousands of them; the default is 8 MB)."""
PHASES = ("claim", "fence", "wait", "scan", "dedup", "commit")
SCRATCH = "/dev/shm" if os.path.isdir("/dev/shm") else None
"""Where the simulated runs go unless $BATCHVLM_BENCH_DIR says: the counts do not depend on the file system, and on a
tmpfs a commit's fsyncs cost nothing, so a hundred thousand units take minutes, not hours."""


class MetadataOps:
    """Counts the metadata operations this process makes under `root` (see the module), by kind and by the phase
    the calling thread is in (`phase`); `calls` keeps (kind, path) of each, in order, where `keep_calls`."""

    def __init__(self, root: Path, keep_calls: bool = True):
        self.root, self.keep_calls = str(root), keep_calls
        self.counts: Counter = Counter()  # (phase, kind) -> operations
        self.calls: list[tuple[str, str]] = []
        self.wait_times: list[float] = []  # when each operation of waiting happened, where `clock` is set
        self.clock: VirtualClock | None = None
        self.local = threading.local()
        self.patched: list[tuple[object, str, object]] = []

    def __enter__(self) -> MetadataOps:
        for owner, name, kind in [(os, "stat", "stat"), (os, "lstat", "stat"), (os, "open", "open"),
                                  (builtins, "open", "open"), (io, "open", "open"), (os, "link", "link"),
                                  (os, "unlink", "unlink"), (os, "remove", "unlink"), (os, "rename", "rename"),
                                  (os, "replace", "rename"), (os, "utime", "utime"), (os, "mkdir", "mkdir"),
                                  (os, "rmdir", "rmdir"), (pa, "OSFile", "open")]:
            self._wrap(owner, name, (kind,))
        for name in ("ParquetFile", "ParquetWriter", "read_table"):  # pyarrow stats a path, then opens it
            self._wrap(pq, name, ("stat", "open"))
        self._wrap(pq, "write_table", ("stat", "open"), path_at=1)
        self._wrap_listing(os, "listdir", "listdir")
        self._wrap_listing(os, "scandir", "scandir")
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original in reversed(self.patched):
            setattr(owner, name, original)
        self.patched.clear()

    @contextmanager
    def phase(self, name: str):
        before = getattr(self.local, "phase", "claim")
        self.local.phase = name
        try:
            yield
        finally:
            self.local.phase = before

    def count(self, kind: str, phase: str | None = None) -> int:
        return sum(n for (p, k), n in self.counts.items() if k == kind and phase in (None, p))

    def by_phase(self) -> dict[str, int]:
        totals = Counter()
        for (phase, _), n in self.counts.items():
            totals[phase] += n
        return dict(totals)

    def _record(self, kind: str, path, n: int = 1) -> None:
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path).startswith(self.root):
            return
        phase = getattr(self.local, "phase", "claim")
        self.counts[(phase, kind)] += n
        if self.keep_calls:
            self.calls.append((kind, os.fspath(path)))
        if phase == "wait" and self.clock is not None:
            self.wait_times += [self.clock.now] * n

    def _wrap(self, owner, name: str, kinds: tuple[str, ...], path_at: int = 0) -> None:
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            for kind in kinds if len(args) > path_at else ():
                self._record(kind, args[path_at])
            return original(*args, **kwargs)

        self.patched.append((owner, name, original))
        setattr(owner, name, counted)

    def _wrap_listing(self, owner, name: str, kind: str) -> None:
        original = getattr(owner, name)

        def counted(path=".", *args, **kwargs):
            found = original(path, *args, **kwargs)
            if kind == "listdir":
                self._record(kind, path, len(found))
                return found
            return _counted_entries(found, lambda: self._record(kind, path))

        self.patched.append((owner, name, original))
        setattr(owner, name, counted)


class _counted_entries:
    """os.scandir's iterator (a context manager too), counting each entry it yields."""

    def __init__(self, entries, on_entry: Callable[[], None]):
        self.entries, self.on_entry = entries, on_entry

    def __iter__(self):
        for entry in self.entries:
            self.on_entry()
            yield entry

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.entries.close()

    def close(self):
        self.entries.close()


class VirtualClock:
    """Virtual seconds for simulated ranks that run as threads, one at a time: a thread that sleeps hands the turn
    to the one due next, and the clock jumps to its time."""

    def __init__(self):
        self.now = 0.0
        self._due: list = []
        self._order = itertools.count()
        self._lock = threading.Lock()
        self.errors: list[BaseException] = []

    def run(self, starts: Iterable[tuple[float, Callable[[], None]]]) -> None:
        """Each target in a thread of its own from its start time; returns once all have ended."""
        stack = threading.stack_size(THREAD_STACK)
        try:
            threads = [self.spawn(start, target) for start, target in starts]
            self._hand_over()
            for thread in threads:
                thread.join()
        finally:
            threading.stack_size(stack)
        if self.errors:
            raise self.errors[0]

    def spawn(self, start: float, target: Callable[[], None]) -> threading.Thread:
        """A thread that runs `target` from virtual time `start` (before `run` lets the threads go)."""
        turn = self._queue(start)
        thread = threading.Thread(target=self._body, args=(turn, target), daemon=True)
        thread.start()
        return thread

    def sleep(self, seconds: float) -> None:
        turn = self._queue(self.now + seconds)
        self._hand_over()
        turn.wait()

    def _queue(self, when: float) -> threading.Event:
        turn = threading.Event()
        with self._lock:
            heapq.heappush(self._due, (when, next(self._order), turn))
        return turn

    def _body(self, turn: threading.Event, target: Callable[[], None]) -> None:
        turn.wait()
        try:
            target()
        except BaseException as error:  # raised by `run` in the main thread
            self.errors.append(error)
        finally:
            self._hand_over()

    def _hand_over(self) -> None:
        with self._lock:
            if not self._due:
                return
            when, _, turn = heapq.heappop(self._due)
            self.now = max(self.now, when)
        turn.set()


class SimulatedRank:
    """A rank's claims, sink and clock: it beats every quarter lease of virtual time while it sleeps (as its
    heartbeat thread would), and its holder's check before a commit is counted as fencing."""

    def __init__(self, layout: RunLayout, plan: Plan, rank: int, clock: VirtualClock, ops: MetadataOps,
                 seed: int):
        self.layout, self.clock, self.ops = layout, clock, ops
        # leases judged on the file system's clock never expire here (real seconds pass slower than virtual ones)
        self.claims = _FencedClaims(layout.claims, owner_name("bench", rank), 1e9, ops)
        self.sink = RunSink(layout, {"batchvlm.family": "bench"}, "none", self.claims, plan.dedup_buckets, rank)
        self.random = random.Random(seed)
        with ops.phase("claim"):
            self.claims.beat()  # as the job's Heartbeat does on start: a holder without a heartbeat counts as dead
        self.beaten = clock.now

    def sleep(self, seconds: float) -> None:
        end = self.clock.now + seconds
        while self.beaten + LEASE_S / 4 < end:
            self.clock.sleep(self.beaten + LEASE_S / 4 - self.clock.now)
            self.beaten = self.clock.now
            with self.ops.phase("claim"):
                self.claims.beat()
        self.clock.sleep(end - self.clock.now)

    def work(self, units: Iterable[tuple[WorkUnit, Claim]]) -> None:
        """Each unit: its records' time on the rank's device, then its commit."""
        for unit, claim in units:
            self.sleep(UNIT_S * self.random.uniform(0.8, 1.2))
            with self.ops.phase("commit"):
                commit_unit(self.sink, unit, claim)


class _FencedClaims(Claims):
    def __init__(self, folder: Path, owner: str, lease_s: float, ops: MetadataOps):
        super().__init__(folder, owner, lease_s)
        self.ops = ops

    def holds(self, claim: Claim) -> bool:
        with self.ops.phase("fence"):
            return super().holds(claim)


def commit_unit(sink: RunSink, unit: WorkUnit, claim: Claim) -> None:
    """A unit of one record (a data row with no image) through the job's sink."""
    sink.start_unit(unit, claim)
    values = {**dict.fromkeys(DATA_SHARD.names), "id": unit.unit_id, "source": "input", "row": unit.start, "text": "",
              "input_ids": [1], "image_spans": [], "token_tags": [0], "num_tokens": 1, "grid_thw": [],
              "original_size": [], "resized_size": [], "image_sha256": [], "image_num_tokens": [],
              "num_image_tokens": 0, "image_embeds": b""}
    record = SourceRecord(unit.unit_id, unit.unit_id, "input", unit.start, "", [])
    sink.add(OutputRow(record, DATA, values, {"fallbacks": {}, "parity": {}}))
    sink.end_unit(unit, 1)


def planned(folder: Path, units: int, world: int, block_units: int) -> tuple[RunLayout, Plan]:
    """A run of `units` units of one record each, planned as the job plans it for `world` ranks."""
    layout = RunLayout(folder)
    work = [WorkUnit(f"input-{i:08d}-{i + 1:08d}", "input", i, i + 1, nbytes=1000) for i in range(units)]
    plan = Plan([InputFile("input", "input")], {}, work, 1, block_units_for(work, block_units, world))
    folder.mkdir(parents=True)
    write_plan(layout, plan)
    return layout, plan


def simulate(layout: RunLayout, plan: Plan, ranks: int, clock: VirtualClock, ops: MetadataOps) -> None:
    """The job's ranks with rundir.frontier: blocks claimed at the frontier, the tail waiting on the board."""
    blocks = {block.task: block for block in plan.blocks()}
    layout.attempt("bench").mkdir(parents=True)

    def rank_of(number: int) -> Callable[[], None]:
        def run() -> None:
            rank = SimulatedRank(layout, plan, number, clock, ops, seed=number)
            looking = "scan" if number == 0 else "wait"  # rank 0 scans the tail, the others wait on its board
            units = units_phase(layout, plan, rank.claims, "bench", number == 0, Backoff.of_tail(POLL_S, LEASE_S))
            units.look = _in_phase(ops, looking, units.look)
            units.work_through(lambda claimed: rank.work(claimed_units(layout, blocks, claimed)), rank.sleep)
            buckets = buckets_phase(layout, plan.dedup_buckets, rank.claims, "bench", number == 0,
                                    Backoff.of_tail(POLL_S, LEASE_S))
            buckets.look = _in_phase(ops, looking, buckets.look)
            buckets.work_through(_in_phase(ops, "dedup", BucketPass(layout, {"input": "input"}, rank.claims)),
                                 rank.sleep)
        return run

    starts = random.Random(0)
    clock.run((starts.uniform(0, START_S), rank_of(number)) for number in range(ranks))


def _in_phase(ops: MetadataOps, phase: str, call: Callable) -> Callable:
    def in_phase(*args):
        with ops.phase(phase):
            return call(*args)
    return in_phase


def measure(ranks: int, units: int, block_units: int, folder: Path) -> dict:
    """One simulated run: its operations per committed unit by phase, and the tail's peak operations a second."""
    clock, started = VirtualClock(), time.perf_counter()
    layout, plan = planned(folder, units, ranks, block_units)
    with MetadataOps(layout.root, keep_calls=False) as ops:
        ops.clock = clock
        simulate(layout, plan, ranks, clock, ops)
    committed = len(committed_units(layout))
    assert committed == units, f"{committed} of {units} units committed"
    phases = ops.by_phase()
    per_second = Counter(int(t) for t in ops.wait_times)
    return {"ranks": ranks, "units": units, "block_units": plan.block_units,
            "per_unit": {phase: phases.get(phase, 0) / units for phase in PHASES},
            "target": sum(phases.get(phase, 0) for phase in PHASES if phase != "commit") / units,
            "wait_peak_per_s": max(per_second.values(), default=0), "virtual_s": clock.now,
            "seconds": time.perf_counter() - started}


def bench_claims(config) -> dict:
    ladder = sorted({ranks for ranks in (8, 64, config.ranks) if ranks <= config.ranks})
    root = Path(tempfile.mkdtemp(prefix="batchvlm-bench-claims-", dir=os.environ.get("BATCHVLM_BENCH_DIR", SCRATCH)))
    rows = []
    try:
        for ranks in ladder:
            rows.append(measure(ranks, config.units, config.block_units, root / f"ranks-{ranks}"))
            print(format_row(rows[-1]), file=sys.stderr, flush=True)  # a long run's progress
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"rows": rows, "units": config.units}


def format_row(row: dict) -> str:
    return (f"{row['ranks']:>5} {row['units']:>7} {row['block_units']:>5} "
            + " ".join(f"{row['per_unit'][p]:>7.2f}" for p in PHASES)
            + f" {row['target']:>8.2f} {row['wait_peak_per_s']:>11} {row['virtual_s'] / 3600:>6.2f} "
              f"{row['seconds']:>7.1f}")


def format_claims(result: dict) -> str:
    lines = [f"claims bench: metadata operations per committed unit, {result['units']} units of one record, "
             f"unit {UNIT_S:.0f} s, poll {POLL_S:.0f} s, lease {LEASE_S:.0f} s",
             f"{'ranks':>5} {'units':>7} {'block':>5} " + " ".join(f"{p:>7}" for p in PHASES)
             + f" {'target':>8} {'wait peak/s':>11} {'sim h':>6} {'real s':>7}"]
    rows = result["rows"]
    lines += [format_row(row) for row in rows]
    if len(rows) > 1:
        lines.append(f"{rows[-1]['ranks']} ranks vs {rows[0]['ranks']}: "
                     f"{rows[-1]['target'] / rows[0]['target']:.2f}x (target: claim + fence + tail + dedup)")
    return "\n".join(lines)
