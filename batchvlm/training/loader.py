"""A resumable, rank-aware loader of packed batches over a run's committed shards.

Every rank computes the same plan for an epoch from token counts alone (no embeddings read): the
shards in a seeded order, records through a seeded shuffle buffer, then first-fit-decreasing over a
packing buffer. Pack g of the plan goes to rank g % world_size, and a rank's k-th batch to DataLoader
worker k % num_workers, which is the order the DataLoader hands them back in. Progress is therefore
one number, the first pack no rank has consumed yet, which is what makes resuming exact, also under
another world size: the packs from there on are dealt again over the new ranks.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from batchvlm.training.reader import (RecordArrays, Runs, ShardColumns, checked_file, read_tensor_group,
                                      row_group_of, row_group_starts, trusted_shards)
from batchvlm.training.packing import PackedBatch, PackingError, first_fit_decreasing, pack_arrays

RecordRef = tuple[int, int]  # (shard index, row)


@dataclass(frozen=True)
class LoaderConfig:
    max_tokens: int = 8192
    """Tokens per packed sequence at most (the trainer's context length)."""
    seed: int = 0
    """With the epoch, fixes the shard order, the shuffle and so every pack."""
    shuffle_buffer: int = 4096
    """Records in the seeded shuffle buffer; 1 keeps the committed order."""
    pack_buffer: int = 256
    """Records sorted together by first-fit-decreasing; larger packs tighter, reorders more."""
    num_workers: int = 2
    """DataLoader worker processes that read and pack; 0 packs in the calling process."""
    allow_unfinished: bool = False
    """Train on the committed units of a run that is not finished yet."""
    checksums: bool = False
    """Check every shard's sha256 against its manifest as the loader opens the run (a read of the whole data, once),
    refusing a damaged shard by name; off, each shard's size is checked."""

    def __post_init__(self) -> None:
        for name in ("max_tokens", "shuffle_buffer", "pack_buffer"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.num_workers < 0:
            raise ValueError(f"num_workers={self.num_workers} must be >= 0")


@dataclass(frozen=True)
class RunIndex:
    """The committed shards of a run, the token count of each of their rows, the first row of each of their row
    groups (then their row count: reader.row_group_starts), and the rows to read: all but the later occurrences of an
    id that the run's duplicate pass listed."""
    shards: list[Path]
    lengths: list[np.ndarray]
    kept: list[np.ndarray]
    groups: list[np.ndarray]

    @classmethod
    def of(cls, runs: Runs, allow_unfinished: bool = False, checksums: bool = False) -> RunIndex:
        """The index of a run, or of a run and its requeue runs (reader.Runs)."""
        shards = trusted_shards(runs, allow_unfinished, checksums)
        files = [checked_file(shard.path) for shard in shards]
        tables = [file.read(columns=["num_tokens", "row"]) for file in files]  # a few bytes a row
        lengths = [table.column("num_tokens").to_numpy().astype(np.int64) for table in tables]
        kept = [np.flatnonzero(~np.isin(table.column("row").to_numpy(), list(shard.skipped)))
                for shard, table in zip(shards, tables)]
        return cls([shard.path for shard in shards], lengths, kept, [row_group_starts(file) for file in files])

    def digest(self) -> str:
        """Names and row counts of the shards: a resumed loader must see the same data."""
        text = "\n".join(f"{path.name}:{len(rows)}" for path, rows in zip(self.shards, self.kept))
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def epoch_order(index: RunIndex, seed: int, epoch: int, buffer: int) -> list[RecordRef]:
    """Every record once: shards in a seeded order, streamed through a seeded shuffle buffer."""
    rng = np.random.default_rng([seed, epoch])
    stream = ((int(s), int(row)) for s in rng.permutation(len(index.shards)) for row in index.kept[s])
    order, pending = [], []
    for ref in stream:
        if len(pending) < buffer:
            pending.append(ref)
            continue
        slot = int(rng.integers(buffer))
        order.append(pending[slot])
        pending[slot] = ref
    return order + [pending[i] for i in rng.permutation(len(pending))]


def plan_packs(index: RunIndex, order: list[RecordRef], max_tokens: int, buffer: int) -> list[list[RecordRef]]:
    """First-fit-decreasing over `buffer` records at a time; the least-filled bin waits for later records."""
    length = lambda ref: int(index.lengths[ref[0]][ref[1]])  # noqa: E731
    for shard, row in order:
        if length((shard, row)) > max_tokens:
            raise PackingError(f"row {row} of {index.shards[shard].name} has {length((shard, row))} tokens, "
                               f"more than max_tokens={max_tokens}")
    packs, pending = [], []
    for position, ref in enumerate(order):
        pending.append(ref)
        last = position == len(order) - 1
        if len(pending) < buffer and not last:
            continue
        bins = [[pending[i] for i in b] for b in first_fit_decreasing([length(r) for r in pending], max_tokens)]
        if not last:
            loosest = min(range(len(bins)), key=lambda b: sum(map(length, bins[b])))
            pending = bins.pop(loosest)
        packs += bins
    return packs


def packing_efficiency(index: RunIndex, packs: list[list[RecordRef]], max_tokens: int) -> float:
    """Real tokens over the tokens the packed sequences could hold."""
    tokens = sum(int(index.lengths[s][r]) for p in packs for s, r in p)
    return tokens / (len(packs) * max_tokens) if packs else 0.0


READ_AHEAD = 2
"""Row groups a worker reads at once, ahead of the one it packs: with one, packing on 2 cores waited on the reads."""

GroupRef = tuple[int, int]  # (shard index, row group)


def resident_bytes(group_bytes: float) -> float:
    """A worker's memory for row groups of this size: the one it packs from and the READ_AHEAD it reads meanwhile
    (records waiting in the shuffle window aside)."""
    return (1 + READ_AHEAD) * group_bytes


class _OpenRowGroups:
    """Each row group read and converted once per worker and epoch, kept until the last of this worker's packs that
    needs it: a worker's memory is row groups, never a whole shard, whatever output.shard_bytes let a shard grow to.

    Memory is therefore the row groups the shuffle window spans (records wait in the shuffle buffer as
    references to their open row group), as a shuffle buffer of materialized records would cost, plus the READ_AHEAD
    row groups being read: a read is decompression in pyarrow, which runs without the GIL, so the next row groups (in
    the order the packs first need them) are read on threads while this one packs.
    """

    def __init__(self, index: RunIndex, packs: list[list[RecordRef]], reader: ThreadPoolExecutor):
        self.index, self.reader, self.open = index, reader, {}
        self.last_use = {self.group_of(shard, row): k for k, refs in enumerate(packs) for shard, row in refs}
        self.to_read = iter(dict.fromkeys(self.group_of(shard, row) for refs in packs for shard, row in refs))
        self.reading: dict[GroupRef, Future] = {}
        self._read_ahead()

    def group_of(self, shard: int, row: int) -> GroupRef:
        return shard, row_group_of(self.index.groups[shard], row)

    def _read_ahead(self) -> None:
        while len(self.reading) < READ_AHEAD and (group := next(self.to_read, None)) is not None:
            self.reading[group] = self.reader.submit(read_tensor_group, self.index.shards[group[0]], group[1])

    def record(self, shard: int, row: int) -> RecordArrays:
        group = self.group_of(shard, row)
        if group not in self.open:
            table = self.reading.pop(group).result()
            self._read_ahead()
            self.open[group] = ShardColumns(table)
        return self.open[group].record(row - int(self.index.groups[shard][group[1]]))

    def done_with(self, pack: int) -> None:
        for group in [g for g in self.open if self.last_use[g] <= pack]:
            del self.open[group]


class _RankPacks(IterableDataset):
    """This rank's packs, dealt over the DataLoader workers in turn."""

    def __init__(self, index: RunIndex, packs: list[list[RecordRef]], max_tokens: int):
        self.index, self.packs, self.max_tokens = index, packs, max_tokens

    def __iter__(self) -> Iterator[PackedBatch]:
        worker = get_worker_info()
        mine = self.packs[worker.id::worker.num_workers] if worker else self.packs
        with ThreadPoolExecutor(READ_AHEAD, thread_name_prefix="batchvlm-shard-read") as reader:
            groups = _OpenRowGroups(self.index, mine, reader)
            for k, refs in enumerate(mine):
                batch = pack_arrays([groups.record(shard, row) for shard, row in refs], self.max_tokens)
                groups.done_with(k)
                yield batch


def _as_is(batch: PackedBatch) -> PackedBatch:
    return batch


def _launch_ranks() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


class PackedLoader:
    """Iterate for one epoch of packed batches; iterate again for the next. `state_dict()` resumes mid-epoch. Reads a
    run, or a run and its requeue runs as one dataset (`[run, requeue_run, ...]`, reader.Runs).

    Every rank gets the same number of batches per epoch (the last < world_size packs of an epoch
    are left out of it), so ranks that step together never wait on one another at the end.
    """

    def __init__(self, runs: Runs, config: LoaderConfig = LoaderConfig(),
                 rank: int | None = None, world_size: int | None = None):
        self.config = config
        launched = _launch_ranks()
        self.rank = launched[0] if rank is None else rank
        self.world_size = launched[1] if world_size is None else world_size
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in 0..world_size-1 ({self.world_size})")
        self.index = RunIndex.of(runs, config.allow_unfinished, config.checksums)
        self.epoch, self.next_pack = 0, 0
        self._plan: tuple[int, list[list[RecordRef]]] | None = None

    def epoch_packs(self) -> list[list[RecordRef]]:
        """The whole plan of the current epoch, every rank's packs (pack g is rank g % world_size's)."""
        if self._plan is None or self._plan[0] != self.epoch:
            self._plan = self.epoch, self._packs_of(self.epoch)
        return self._plan[1]

    def _packs_of(self, epoch: int) -> list[list[RecordRef]]:
        c = self.config
        return plan_packs(self.index, epoch_order(self.index, c.seed, epoch, c.shuffle_buffer), c.max_tokens,
                          c.pack_buffer)

    def batches_in_epoch(self, epoch: int) -> int:
        """Batches each rank gets in epoch `epoch`, from its start (its packs may number differently from another
        epoch's: each epoch packs its own shuffle)."""
        return len(self.epoch_packs() if epoch == self.epoch else self._packs_of(epoch)) // self.world_size

    def __len__(self) -> int:
        """Batches this rank still gets in the current epoch."""
        return (len(self.epoch_packs()) - self.next_pack) // self.world_size

    def _rank_packs(self) -> list[list[RecordRef]]:
        start = self.next_pack + self.rank
        return self.epoch_packs()[start:start + len(self) * self.world_size:self.world_size]

    def __iter__(self) -> Iterator[PackedBatch]:
        dataset = _RankPacks(self.index, self._rank_packs(), self.config.max_tokens)
        batches = iter(dataset) if self.config.num_workers == 0 else iter(DataLoader(
            dataset, batch_size=None, num_workers=self.config.num_workers, collate_fn=_as_is))
        for batch in batches:
            self.next_pack += self.world_size  # every rank steps in lockstep: this batch's round is consumed
            yield batch
        self.epoch, self.next_pack = self.epoch + 1, 0

    def rewind(self) -> None:
        """Back to the start of epoch 0, whose plan is kept (an eval loader's every pass: the same batches)."""
        self.epoch, self.next_pack = 0, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "next_pack": self.next_pack, "world_size": self.world_size,
                "data": self.index.digest(), "config": asdict(self.config)}

    def load_state_dict(self, state: dict) -> None:
        """Resume where `state` was taken. Another world size is fine: the packs not yet consumed are dealt
        over the new ranks. Other data or another packing config would not give the same packs: refused."""
        if state["data"] != self.index.digest():
            raise ValueError("the run's committed shards differ from those the state was taken on "
                             f"({state['data']} vs {self.index.digest()}); resuming would skip or repeat records")
        planned = {k: v for k, v in state["config"].items()
                   if k not in ("num_workers", "allow_unfinished", "checksums")}
        ours = {k: v for k, v in asdict(self.config).items() if k in planned}
        if planned != ours:
            raise ValueError(f"the state was taken with {planned}, this loader has {ours}: the packs would differ")
        self.epoch, self.next_pack = state["epoch"], state["next_pack"]
