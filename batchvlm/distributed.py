"""Ranks under `accelerate launch` (or srun + accelerate, or plain python): who am I, and barriers.

Everything else is coordinated through the shared run directory, so nothing here assumes one node.
"""

from __future__ import annotations

import json
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import PartialState

from batchvlm.sink import durable_write_json


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

    def close(self) -> None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def init_ranks(device: str) -> tuple[Ranks, torch.device]:
    """The process's rank and the device it owns (cuda:<local rank> on GPUs)."""
    on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    state = PartialState(cpu=on_cpu)
    ranks = Ranks(state.process_index, state.num_processes, state.local_process_index, state)
    if on_cpu:
        return ranks, torch.device("cpu")
    if device in ("auto", "cuda"):
        return ranks, torch.device("cuda", ranks.local_rank)
    return ranks, torch.device(device)


class Coordinator:
    """Per-attempt rank state in the shared run directory: progress counts and done markers.

    Ranks finish at different times; waiting for the others through files, not a collective,
    means a long tail on one rank can never time out a barrier.
    """

    def __init__(self, run_dir: Path, ranks: Ranks):
        self.ranks = ranks
        self.root = run_dir / "ranks"
        token = self.root / "attempt.json"
        if ranks.is_main:
            if self.root.exists():
                shutil.rmtree(self.root)
            self.root.mkdir(parents=True)
            durable_write_json(token, {"attempt": uuid.uuid4().hex, "world": ranks.world})
        ranks.barrier()
        self.attempt = self.root / json.loads(token.read_text())["attempt"]
        self.attempt.mkdir(parents=True, exist_ok=True)
        self._last_report = 0.0

    def _file(self, rank: int, kind: str) -> Path:
        return self.attempt / f"rank-{rank:05d}.{kind}.json"

    def report(self, records_done: int, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last_report > 1.0:
            self._last_report = now
            durable_write_json(self._file(self.ranks.rank, "progress"), {"records": records_done})

    def records_done(self) -> int:
        total = 0
        for rank in range(self.ranks.world):
            try:
                total += json.loads(self._file(rank, "progress").read_text())["records"]
            except (FileNotFoundError, json.JSONDecodeError):
                continue
        return total

    def done(self, stats: dict) -> None:
        self.report(stats.get("records", 0), force=True)
        durable_write_json(self._file(self.ranks.rank, "done"), stats)

    def wait_for_all(self, on_tick=None) -> list[dict]:
        """Rank 0: block until every rank of this attempt is done; returns their stats."""
        files = [self._file(rank, "done") for rank in range(self.ranks.world)]
        while not all(f.exists() for f in files):
            if on_tick:
                on_tick()
            time.sleep(0.2)
        return [json.loads(f.read_text()) for f in files]
