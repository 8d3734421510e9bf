"""Where a run stands, from any node, while it runs: `batchvlm-status run_dir=...`.

It reads what the run keeps for it, never the manifests: the plan (units and their records, one file), each rank's
report (rundir.rank_reports, one small file per rank of each launch), the claim frontier's hint, the heartbeats (one
listing of the claims' heartbeats) and, once the run is complete, its totals (written last, RunLayout.success). A
thousand ranks cost a thousand small reads, a run of a million units none more.

Committed counts are the sum of the ranks' reports, each as fresh as its rank's last commit. Rates come from each
rank's last samples (its own clock), and so do the ages of the units a rank holds (since it claimed them; plus the time
since its report, on this host's clock); heartbeat ages from the file system's times against this host's clock, so a
clock that differs from the file server's shifts them (by what `date` and the server disagree), and a heartbeat from
this host's future is shown as such, with the skew. Metadata that batchvlm did not write, or that is damaged, is named
in a DamagedMetadata error, not a traceback.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from tqdm import tqdm

from batchvlm.config import ConfigError
from batchvlm.rundir.claims import AHEAD_S, LEASE_S, Beat, last_beats, rank_of_owner
from batchvlm.rundir.durable import DamagedMetadata, read_json
from batchvlm.rundir.frontier import claimed_so_far
from batchvlm.rundir.layout import RunLayout
from batchvlm.rundir.upgrade import check_run_format
from batchvlm.rundir.rank_reports import AT, RECORDS_COMMITTED, UNITS_COMMITTED, RankReport, Sample, read_reports
from batchvlm.rundir.workunits import read_plan

WINDOW_S = 300.0
"""The rate is taken over each rank's samples of the last this many seconds."""


SHOWN_UNITS = 3
"""Units in progress named in the text status, the longest held first."""


@dataclass(frozen=True)
class RankStatus:
    attempt: str
    rank: int
    host: str
    heartbeat_age_s: float | None  # None: no heartbeat found
    report_age_s: float
    records: int  # seen by this rank in its launch
    units_held: int
    units_committed: int
    rate: float | None  # records committed per second over its recent samples
    finished: bool
    stale: bool  # not finished, and its heartbeat older than the lease, or its process gone from this host
    why_stale: str = ""
    holding: list[tuple[str, float]] = field(default_factory=list)  # (unit, seconds held), the longest held first
    clock_ahead_s: float = 0.0  # its heartbeat is this far in this host's future (its host's clock is ahead)

    @property
    def live(self) -> bool:
        return not (self.finished or self.stale)


@dataclass(frozen=True)
class RunStatus:
    run_dir: Path
    state: str  # complete | running | duplicate pass | stopped | starting (ranks beat, none reported) | not started
    units_total: int
    units_committed: int
    records_total: int | None  # None: some units do not know their rows (tar shards) before they are read
    records_in: int
    written: int
    quarantined: int
    by_check: dict[str, int]
    bytes_written: int
    rate: float | None = None  # records committed per second, every live rank together
    unit_rate: float | None = None
    eta_s: float | None = None
    ranks: list[RankStatus] = field(default_factory=list)
    lease_s: float = LEASE_S
    seconds: float | None = None  # a complete run: how long it took
    blocks_claimed: int = 0  # how far the claim frontier got (its hint: one short after a crash between a claim and it)
    blocks_total: int = 0

    @property
    def stale_ranks(self) -> list[RankStatus]:
        return [rank for rank in self.ranks if rank.stale]

    @property
    def in_progress(self) -> list[tuple[str, RankStatus, float]]:
        """(unit, its rank, seconds held) of every unit a live rank holds, the longest held first."""
        held = [(unit, rank, age) for rank in self.ranks if rank.live for unit, age in rank.holding]
        return sorted(held, key=lambda entry: -entry[2])


def run_status(run_dir: Path, now: float | None = None, window_s: float = WINDOW_S) -> RunStatus:
    layout = RunLayout(Path(run_dir))
    if not layout.plan.exists():
        raise ConfigError(f"{run_dir} holds no batchvlm run (no plan): give run_dir=<output.root>/<run_name> of a run "
                          "that has started")
    check_run_format(layout)
    now = time.time() if now is None else now
    plan = read_plan(layout)
    records_total = plan.rows()
    if (summary := read_json(layout.success)) is not None:
        return _complete(layout, summary, records_total)
    lease_s = _lease_s(layout)
    beats = {rank_of_owner(beat.owner): beat for beat in last_beats(layout.claims)}
    reports = [report for attempt in layout.attempts() for report in read_reports(layout, attempt)]
    ranks = [_rank_status(report, beats.get((report.attempt, report.rank)), now, lease_s, window_s)
             for report in reports]
    committed = [report.units for report in reports]
    by_check = sum((units.by_check for units in committed), Counter())
    units_committed = sum(u.committed for u in committed)
    starting = not ranks and any(now - beat.at <= lease_s and not beat.gone for beat in beats.values())
    state = "starting" if starting else _state(ranks, units_committed, len(plan.units))
    status = RunStatus(
        layout.root, state, len(plan.units), units_committed, records_total,
        sum(u.records_in for u in committed), sum(u.written for u in committed),
        sum(u.quarantined for u in committed), dict(sorted(by_check.items())), sum(u.bytes for u in committed),
        ranks=ranks, lease_s=lease_s, blocks_claimed=claimed_so_far(layout, tasks=plan.blocks().tasks),
        blocks_total=math.ceil(len(plan.units) / plan.block_units))
    return _with_rates(status, reports, ranks, window_s)


def _complete(layout: RunLayout, summary: dict, records_total: int | None) -> RunStatus:
    try:
        return RunStatus(layout.root, "complete", summary["units"], summary["units_committed"], records_total,
                         summary["records_in"], summary["written"], summary["quarantined"], summary["by_check"],
                         summary.get("bytes", 0), seconds=summary.get("seconds"))
    except (KeyError, TypeError) as error:
        raise DamagedMetadata.of(layout.success, "a run's totals", error) from None


def _lease_s(layout: RunLayout) -> float:
    """runtime.lease_s of the config that started the run (the default where it cannot be read)."""
    try:
        return float(yaml.safe_load(layout.config.read_text())["runtime"]["lease_s"])
    except (FileNotFoundError, KeyError, TypeError, ValueError, yaml.YAMLError):
        return LEASE_S


def _rank_status(report: RankReport, beat: Beat | None, now: float, lease_s: float, window_s: float) -> RankStatus:
    age = None if beat is None else max(0.0, now - beat.at)
    ahead = 0.0 if beat is None or beat.at - now <= AHEAD_S else beat.at - now
    why = ""
    if not report.finished:
        if beat is not None and beat.gone:
            why = "its process is gone"
        elif age is None or age > lease_s:
            why = "no heartbeat" if age is None else f"no heartbeat for {age:.0f} s (lease {lease_s:g} s)"
    since_report = max(0.0, now - report.at)
    holding = [] if report.finished else sorted(
        ((unit, report.at - claimed + since_report) for unit, claimed in report.units.holding.items()),
        key=lambda entry: -entry[1])
    return RankStatus(report.attempt, report.rank, report.host, age, since_report, report.records,
                      0 if report.finished else report.units.held, report.units.committed,
                      None if report.finished else _rate(report.samples, RECORDS_COMMITTED, window_s),
                      report.finished, bool(why), why, holding, ahead)


def _rate(samples: list[Sample], count: int, window_s: float) -> float | None:
    """A count's growth per second over the samples of the last `window_s` (the rank's own clock); None with fewer
    than two. Committed counts, not records seen: a rank's workers run ahead of its commits by its queues."""
    recent = [sample for sample in samples if sample[AT] >= samples[-1][AT] - window_s] if samples else []
    if len(recent) < 2 or recent[-1][AT] <= recent[0][AT]:
        return None
    return (recent[-1][count] - recent[0][count]) / (recent[-1][AT] - recent[0][AT])


def _state(ranks: list[RankStatus], committed: int, total: int) -> str:
    if not ranks:
        return "not started"
    if not any(rank.live for rank in ranks):
        return "stopped"
    return "duplicate pass" if committed >= total else "running"


def _with_rates(status: RunStatus, reports: list[RankReport], ranks: list[RankStatus], window_s: float) -> RunStatus:
    """The run's rates (its live ranks' together) and the ETA: by records where the plan knows them, else by units."""
    rates = [rank.rate for rank in ranks if rank.live and rank.rate is not None]
    unit_rates = [rate for report, rank in zip(reports, ranks)
                  if rank.live and (rate := _rate(report.samples, UNITS_COMMITTED, window_s)) is not None]
    rate = sum(rates) if rates else None
    unit_rate = sum(unit_rates) if unit_rates else None
    eta = None
    if status.records_total is not None and rate:
        eta = max(0, status.records_total - status.records_in) / rate
    elif unit_rate:
        eta = max(0, status.units_total - status.units_committed) / unit_rate
    return dataclasses.replace(status, rate=rate, unit_rate=unit_rate, eta_s=eta)


def format_status(status: RunStatus) -> str:
    lines = [f"{status.run_dir}: {_headline(status)}"]
    done = status.units_committed / status.units_total if status.units_total else 1.0
    held = sum(rank.units_held for rank in status.ranks if not rank.stale)
    orphaned = sum(rank.units_held for rank in status.stale_ranks)
    lines.append(f"units:       {status.units_committed:,} / {status.units_total:,} committed ({100 * done:.1f}%)"
                 + (f", {held:,} held" if held else "")
                 + (f", {orphaned:,} held by stale ranks (taken over once their leases expire)" if orphaned else ""))
    if status.blocks_total:
        lines.append(f"claimed:     {status.blocks_claimed:,} / {status.blocks_total:,} blocks of units (the claim "
                     "frontier; blocks a dead rank held are handed out again)")
    if in_progress := status.in_progress:
        lines.append(f"in progress: {len(in_progress):,} units held by live ranks, the longest first (held since "
                     "claimed)")
        lines += [f"{'':13}{tqdm.format_interval(age)}  rank {rank.rank}  {unit}"
                  for unit, rank, age in in_progress[:SHOWN_UNITS]]
        if (more := len(in_progress) - SHOWN_UNITS) > 0:
            lines.append(f"{'':13}and {more:,} more")
    of = f" of {status.records_total:,}" if status.records_total is not None else ""
    share = 100 * status.quarantined / status.records_in if status.records_in else 0.0
    lines.append(f"records:     {status.records_in:,}{of} in committed units: {status.written:,} written, "
                 f"{status.quarantined:,} quarantined ({share:.2f}%)")
    if status.by_check:
        lines.append("quarantined: " + ", ".join(f"{check} {n:,}" for check, n in
                                                  sorted(status.by_check.items(), key=lambda item: -item[1])))
    lines.append(f"written:     {readable_bytes(status.bytes_written)} in committed units")
    if status.state == "complete":
        if status.seconds:
            lines.append(f"took:        {tqdm.format_interval(status.seconds)}")
        return "\n".join(lines)
    if status.rate is not None:
        lines.append(f"rate:        {status.rate:,.1f} records/s committed over the last {WINDOW_S / 60:.0f} min"
                     + (f", {status.unit_rate:.3g} units/s" if status.unit_rate else "")
                     + (f"; eta {tqdm.format_interval(status.eta_s)}" if status.eta_s is not None else ""))
    else:
        lines.append("rate:        not known yet (from two reports of a live rank: after its commits, and once a "
                     "runtime.progress_interval_s)")
    if status.ranks:
        lines.append("")
        lines += _rank_table(status.ranks)
    if ahead := [rank for rank in status.ranks if rank.clock_ahead_s]:
        lines.append(f"clock skew:  the heartbeats of {len(ahead)} rank(s) are up to "
                     f"{max(rank.clock_ahead_s for rank in ahead):.0f} s ahead of this host's clock: their hosts' clocks "
                     "are ahead (or this one's behind); a rank takes over their units one lease after it first sees "
                     "their last beat")
    return "\n".join(lines)


def _headline(status: RunStatus) -> str:
    if status.state == "starting":
        return "starting: its ranks beat, none has reported yet (loading the model, planning)"
    if status.state in ("complete", "not started"):
        return status.state
    live = sum(rank.live for rank in status.ranks)
    stale = len(status.stale_ranks)
    text = f"{status.state}, {live} rank(s) live" + (f", {stale} STALE" if stale else "")
    if status.state == "stopped":
        text += ": no rank is working on it; launch the job again to finish it"
    return text


def _rank_table(ranks: list[RankStatus]) -> list[str]:
    rows = [("launch", "rank", "host", "heartbeat", "held", "committed", "records seen", "committed/s", "state")]
    for rank in ranks:
        state = "finished" if rank.finished else f"STALE: {rank.why_stale}" if rank.stale else "ok"
        rows.append((rank.attempt, str(rank.rank), rank.host,
                     "-" if rank.heartbeat_age_s is None else
                     f"{rank.clock_ahead_s:.0f} s ahead" if rank.clock_ahead_s else f"{rank.heartbeat_age_s:.0f} s ago",
                     str(rank.units_held), str(rank.units_committed), f"{rank.records:,}",
                     "-" if rank.rate is None else f"{rank.rate:,.1f}", state))
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]


def readable_bytes(nbytes: float) -> str:
    """Bytes in the unit that shows them best: 512 B, 3.4 MB, 1.25 TB."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"

