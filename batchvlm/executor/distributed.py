"""Ranks under `accelerate launch` (or srun + accelerate, or plain python): who am I, and barriers.

Everything else is coordinated through the shared run directory, so nothing here assumes one node.
"""

from __future__ import annotations

import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import PartialState

from batchvlm.devices import on_cpu
from batchvlm.rundir.claims import Claims, owner_name, rank_owners
from batchvlm.rundir.durable import durable_write_json
from batchvlm.rundir.layout import RunLayout
from batchvlm.rundir.rank_reports import RankReporter, RankUnits, read_rank_files, read_reports


@dataclass
class Ranks:
    rank: int
    world: int
    local_rank: int
    state: PartialState

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            self.state.wait_for_everyone()

    def broadcast(self, value):
        """Rank 0's value, on every rank."""
        if self.world == 1:
            return value
        shared = [value]
        torch.distributed.broadcast_object_list(shared, src=0)
        return shared[0]

    def close(self) -> None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def init_ranks(device: str) -> tuple[Ranks, torch.device]:
    """The process's rank and the device it owns (cuda:<local rank> on GPUs)."""
    cpu = on_cpu(device)
    state = PartialState(cpu=cpu)
    ranks = Ranks(state.process_index, state.num_processes, state.local_process_index, state)
    if cpu:
        return ranks, torch.device("cpu")
    if device in ("auto", "cuda"):
        return ranks, torch.device("cuda", ranks.local_rank)
    return ranks, torch.device(device)


class Coordinator:
    """One launch's ranks in the shared run directory: this attempt's progress counts, and the claims it shares with
    every other attempt on the run (rundir.claims).

    Ranks meet only here once they have started: they claim units and buckets through files, and the
    end of the run is every unit and bucket committed, not a collective, so a long tail on one rank
    can never time out a barrier and a dead rank costs only the units it held. Another launch on the
    same run directory (a restart, or a second job) claims beside this one; none removes the other's state.
    """

    def __init__(self, layout: RunLayout, ranks: Ranks, report_s: float, units: RankUnits):
        self.ranks = ranks
        self.layout = layout
        self.report_s = report_s
        self.attempt = ranks.broadcast(uuid.uuid4().hex[:12])  # every rank of this launch, and no other, shares it
        layout.attempt(self.attempt).mkdir(parents=True, exist_ok=True)
        self.owner = owner_name(self.attempt, ranks.rank)
        self.reporter = RankReporter(layout, self.attempt, ranks.rank, units)
        self._last_report = self._last_read = -float("inf")
        self._others = 0

    def claims(self, lease_s: float) -> Claims:
        return Claims(self.layout.claims, self.owner, lease_s)

    def _file(self, rank: int, kind: str) -> Path:
        return self.layout.rank_file(self.attempt, rank, kind)

    def report(self, records_done: int, finished: bool = False) -> None:
        """This rank's report (rundir.rank_reports) for rank 0's progress and for batchvlm-status: once a `report_s`
        (runtime.progress_interval_s), and after a unit commits. A file a thousand ranks rewrote every second would
        cost the metadata server more than their claims; one per unit costs what the commit does, a few operations."""
        now = time.monotonic()
        if finished or self.reporter.has_news() or now - self._last_report > self.report_s:
            self._last_report = now
            self.reporter.write(records_done, finished)

    def records_done(self, own: int) -> int:
        """Every rank's records: this rank's `own` count now, the others' as they last reported (read at most once a
        `report_s`)."""
        now = time.monotonic()
        if now - self._last_read > self.report_s:
            self._last_read = now
            self._others = sum(report.records for report in read_reports(self.layout, self.attempt)
                               if report.rank != self.ranks.rank)
        return own + self._others

    def done(self, stats: dict) -> None:
        self.report(stats.get("records", 0), finished=True)
        durable_write_json(self._file(self.ranks.rank, "done"), stats)

    def rank_stats(self, claims: Claims, poll_s: float) -> list[dict]:
        """Rank 0: what every rank reported once it finished; a rank whose heartbeat expired reports nothing."""
        def settled(rank: int) -> bool:
            return self._file(rank, "done").exists() or claims.expired(rank_owners(self.attempt, rank))

        while not all(settled(rank) for rank in range(self.ranks.world)):
            time.sleep(poll_s)
        return self._read_all("done")

    def retire(self, claims: Claims) -> None:
        """Rank 0 of a finished run: this launch's state goes, and the claims too once no other launch is alive."""
        shutil.rmtree(self.layout.attempt(self.attempt), ignore_errors=True)
        if all(owner.startswith(f"{self.attempt}-") for owner in claims.alive_holders()):
            shutil.rmtree(self.layout.ranks, ignore_errors=True)

    def _read_all(self, kind: str) -> list[dict]:
        return read_rank_files(self.layout, self.attempt, kind)
