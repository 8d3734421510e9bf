"""What each rank of a launch says of itself in the run directory, for rank 0's progress line and `batchvlm-status`.

A rank rewrites one small file (RunLayout.rank_file(attempt, rank, "progress")) as its embedding starts, once a
runtime.progress_interval_s, and after each block it claims and each unit it commits: the records it has seen, the units
it claimed, committed and lost, the units it holds and since when, what its committed units hold, and its last few
samples of its counts, from which a reader takes the rates. Summed over every
launch's ranks, the committed counts are the run's (a unit commits once): a status reads one file per rank, never the
manifests. Not made durable: a file lost in a crash costs the counts of at most the units committed since the rank's
last report, until the run's totals (RunLayout.success) replace them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import threading
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass, field

from batchvlm.rundir.durable import replace_json
from batchvlm.rundir.layout import RunLayout
from batchvlm.rundir.manifest import Manifest

PROGRESS = "progress"
"""The kind of a rank's file (RunLayout.rank_file) that holds its RankReport."""
SAMPLES = 32
"""The samples a report keeps: at one a progress interval (30 s by default), the last quarter of an hour or so."""


@dataclass
class RankUnits:
    """A rank's units: claimed (the units of the blocks it claimed that were not committed yet), committed by it, lost
    (another holder committed or took them over first), what its committed units hold, and the units it holds now
    (claimed, neither committed nor lost) with when it claimed each (its clock). Claims are counted on the thread that
    claims, commits and losses on the sink's, and the report is taken on the main thread: `snapshot`."""

    claimed: int = 0
    committed: int = 0
    lost: int = 0
    records_in: int = 0
    written: int = 0
    quarantined: int = 0
    bytes: int = 0
    by_check: Counter = field(default_factory=Counter)
    holding: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()  # not a field: a commit's counts change together

    @property
    def held(self) -> int:
        """Claimed and neither committed nor lost yet: what the rank is working on, or has queued."""
        return max(0, self.claimed - self.committed - self.lost)

    def hold(self, unit_ids: list[str], at: float | None = None) -> None:
        """Units the rank claimed (a block's, but those committed already), at `at` (now)."""
        at = time.time() if at is None else at
        with self._lock:
            self.claimed += len(unit_ids)
            self.holding.update(dict.fromkeys(unit_ids, at))

    def commit(self, manifest: Manifest) -> None:
        with self._lock:
            self.records_in += manifest.records_in
            self.written += manifest.written
            self.quarantined += manifest.quarantined
            self.bytes += sum(listing.bytes for listing in manifest.listings())
            self.by_check.update(manifest.checks)
            self.committed += 1
            self.holding.pop(manifest.unit, None)

    def lose(self, unit_id: str) -> None:
        with self._lock:
            self.lost += 1
            self.holding.pop(unit_id, None)

    def snapshot(self) -> RankUnits:
        with self._lock:
            return dataclasses.replace(self, by_check=Counter(self.by_check), holding=dict(self.holding))


Sample = tuple[float, int, int, int]
"""(at, records seen, units committed, records in the committed units): a rank's counts when it reported."""
AT, SEEN, UNITS_COMMITTED, RECORDS_COMMITTED = range(4)


@dataclass(frozen=True)
class RankReport:
    attempt: str
    rank: int
    host: str
    pid: int
    at: float  # the rank's clock (time.time) when it wrote the report
    records: int  # records seen: those of units not committed yet too
    units: RankUnits
    samples: list[Sample]  # oldest first
    finished: bool = False

    def to_json(self) -> dict:
        return {**asdict(self), "units": {**asdict(self.units), "by_check": dict(self.units.by_check)}}

    @classmethod
    def from_json(cls, raw: dict) -> RankReport:
        units = raw.get("units", {})
        return cls(attempt=raw.get("attempt", ""), rank=int(raw["rank"]), host=raw.get("host", ""),
                   pid=int(raw.get("pid", 0)), at=float(raw.get("at", 0.0)), records=int(raw.get("records", 0)),
                   units=RankUnits(**{**units, "by_check": Counter(units.get("by_check", {}))}),
                   samples=[tuple(sample) for sample in raw.get("samples", [])],
                   finished=bool(raw.get("finished", False)))


class RankReporter:
    """Writes one rank's report, keeping its last SAMPLES samples."""

    def __init__(self, layout: RunLayout, attempt: str, rank: int, units: RankUnits):
        self.path = layout.rank_file(attempt, rank, PROGRESS)
        self.attempt, self.rank, self.units = attempt, rank, units
        self.samples: deque = deque(maxlen=SAMPLES)
        self.reported = (-1, -1)  # (committed, claimed) when last reported

    def has_news(self) -> bool:
        """A unit claimed or committed since the last report."""
        return (self.units.committed, self.units.claimed) != self.reported

    def write(self, records: int, finished: bool = False) -> None:
        now = time.time()
        units = self.units.snapshot()
        self.reported = (units.committed, units.claimed)
        self.samples.append((now, records, units.committed, units.records_in))
        report = RankReport(self.attempt, self.rank, socket.gethostname(), os.getpid(), now, records, units,
                            list(self.samples), finished)
        replace_json(self.path, report.to_json())


def read_rank_files(layout: RunLayout, attempt: str, kind: str) -> list[dict]:
    """One launch's rank files of a kind (RunLayout.rank_file), a file gone or torn meanwhile left out."""
    found = []
    for path in layout.rank_files(attempt, kind):
        try:
            found.append(json.loads(path.read_text()))
        except (FileNotFoundError, json.JSONDecodeError):
            continue
    return found


def read_reports(layout: RunLayout, attempt: str) -> list[RankReport]:
    """The reports of one launch's ranks, by rank (one not in this shape is left out)."""
    found = []
    for raw in read_rank_files(layout, attempt, PROGRESS):
        try:
            found.append(RankReport.from_json(raw))
        except (KeyError, TypeError, ValueError):
            continue
    return sorted(found, key=lambda report: report.rank)
