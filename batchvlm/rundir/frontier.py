"""Claiming the tasks of an ordered list in a few metadata operations each, whatever the number of ranks, and the
tail, where ranks with nothing left to claim wait on one small file.

Two lists go through here, one after the other: the plan's blocks of units (consecutive units of the claim order,
claimed as one task and worked through by the rank that holds it, rundir.workunits) and the duplicate pass's buckets.
A claim is a claim of rundir.claims (exclusive, leased, taken over when its holder's lease expires, fenced); only
how a rank finds the next task to claim is decided here.

The frontier. A fresh task is claimed in list order, task k only by a rank that saw task k-1 claimed, so the claimed
tasks are a prefix of the list. Where the prefix ends is read from a hint file that every claimer rewrites after its
claim: a claim costs a read of the hint, a stat and the claim itself, not a walk over the list, and no rank looks at
a task another rank took. A stale or missing hint (a crash between a claim and its hint, a restart after the claims
were removed) costs a gallop: steps that double past claimed tasks, then halve back.

The tail. Once a rank has claimed all it can, it waits on its launch's board. Rank 0 of each launch writes the board:
once it has nothing left to claim, it scans what is left of the list, each task's parts not seen done yet (a unit's
manifest, a bucket's result: each read until it is there, then never again) and, for a task not done, whether it is
free (never claimed, or its holder's lease expired). Every other rank reads the board (one small file) with backoff,
never the run itself. The tasks a board frees are handed out like fresh ones, through a hint over the board's list,
so a thousand idle ranks do not all try the first.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from batchvlm.records import WorkUnit
from batchvlm.rundir.claims import Claim, Claims, ever_claimed
from batchvlm.rundir.dedup import IdsGather, bucket_of_task, bucket_task
from batchvlm.rundir.durable import replace_json
from batchvlm.rundir.layout import RunLayout
from batchvlm.rundir.rank_reports import RankUnits
from batchvlm.rundir.workunits import Block, Plan

UNITS, DEDUP = "units", "dedup"
"""The two phases of a run: the plan's blocks of units, then the duplicate pass's buckets."""


class Backoff:
    """Waits that double from `first` up to `cap`, and start again from `first` once there was something to do."""

    def __init__(self, first: float, cap: float):
        self.first, self.cap = first, max(first, cap)
        self.wait = first

    @classmethod
    def of_tail(cls, poll_s: float, lease_s: float) -> Backoff:
        """From runtime.poll_s up to eight times that, and never longer than a quarter lease, so that a lease that
        expires is seen within about a quarter lease more."""
        return cls(poll_s, min(8 * poll_s, lease_s / 4))

    def next(self) -> float:
        wait, self.wait = self.wait, min(self.cap, self.wait * 2)
        return wait

    def reset(self) -> None:
        self.wait = self.first


class Hint:
    """How far a walk over a list got, as the last claimer wrote it. Not made durable: a hint lost in a crash costs a
    gallop, never a claim. `version` tells the lists of successive boards apart."""

    def __init__(self, path: Path, owner: str):
        self.path = path
        self.tmp = path.with_name(f".{path.name}.{owner}.{os.getpid()}")  # workers of one rank share the owner

    def read(self, version: int = 0) -> int:
        try:
            written, position = map(int, self.path.read_text().split())
        except (FileNotFoundError, ValueError):
            return 0
        return position if written == version else 0

    def write(self, position: int, version: int = 0) -> None:
        """Move the hint on to `position`; a claimer of an earlier task that writes last leaves the hint where it is
        (read just before, so only a write in that instant can still take it back)."""
        if self.read(version) >= position:
            return
        self.tmp.write_text(f"{version} {position}")
        os.replace(self.tmp, self.path)


class Frontier:
    """Claims of the tasks of a list, in list order, from where the hint says the last claimer got to.

    `take` claims a task (None where another rank has it). With `taken` (one stat: was the task ever claimed), the
    claimed tasks are a prefix of the list, and a stale hint is corrected by galloping to the prefix's end; without
    it (the tasks a board frees, taken over in any order), the walk goes on from the hint one task at a time."""

    def __init__(self, tasks: Sequence[str], hint: Hint, take: Callable[[str], Claim | None],
                 taken: Callable[[str], bool] | None = None, version: int = 0):
        self.tasks, self.hint, self.take, self.taken, self.version = tasks, hint, take, taken, version
        self.position = 0

    def __iter__(self) -> Iterator[Claim]:
        while (claim := self.next()) is not None:
            yield claim

    def next(self) -> Claim | None:
        """The next task this rank wins, or None once the list is all claimed."""
        position = max(self.position, self.hint.read(self.version))
        if self.taken is not None:
            position = end_of_prefix(self.tasks, self.taken, position)
        while position < len(self.tasks):
            claim = self.take(self.tasks[position])
            position += 1
            if claim is not None:
                self.position = position
                self.hint.write(position, self.version)
                return claim
        self.position = position
        return None

def end_of_prefix(tasks: Sequence[str], taken: Callable[[str], bool], start: int) -> int:
    """The first task from `start` on that nobody claimed, where the claimed tasks are a prefix of `tasks`: steps that
    double past claimed tasks, then halve (a few stats past a stale hint)."""
    if start >= len(tasks) or not taken(tasks[start]):
        return start
    claimed, step = start, 1
    while claimed + step < len(tasks) and taken(tasks[claimed + step]):
        claimed, step = claimed + step, step * 2
    free = min(claimed + step, len(tasks))
    while free - claimed > 1:
        middle = (claimed + free) // 2
        claimed, free = (middle, free) if taken(tasks[middle]) else (claimed, middle)
    return free


@dataclass(frozen=True)
class Board:
    """What rank 0 of a launch last saw of a phase's tail: whether every task is done, and the tasks that are free
    (never claimed, or their holder's lease expired). `version` counts the boards that differed."""

    version: int
    done: bool
    free: tuple[str, ...] = ()


def read_board(path: Path) -> Board | None:
    """The board, or None where rank 0 has not written one yet."""
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    return Board(raw["version"], raw["done"], tuple(raw["free"]))


def write_board(path: Path, board: Board) -> None:
    replace_json(path, asdict(board))  # rewritten as the tail goes: a reader sees a whole board


class TailScan:
    """Rank 0's look at what is left of a phase (see the module): `parts` are each task's parts, `part_done` tells
    whether a part is done, `on_done` runs once every part is, before the board says so."""

    def __init__(self, claims: Claims, parts: dict[str, list[str]], part_done: Callable[[str], bool], board: Path,
                 on_done: Callable[[], None] = lambda: None):
        self.claims, self.part_done, self.path, self.on_done = claims, part_done, board, on_done
        self.left = {task: list(task_parts) for task, task_parts in parts.items()}
        self.board = Board(0, False)

    def __call__(self) -> Board:
        free, now = [], None
        for task, parts in list(self.left.items()):
            while parts and self.part_done(parts[0]):  # a task's parts are done about in order: look at the first
                parts.pop(0)
            if not parts:
                del self.left[task]
                continue
            now = self.claims.now() if now is None else now
            if self.claims.claimable(task, now):
                free.append(task)
        done = not self.left
        if done and not self.board.done:
            self.on_done()
        if (done, tuple(free)) != (self.board.done, self.board.free):
            self.board = Board(self.board.version + 1, done, tuple(free))
            write_board(self.path, self.board)
        return self.board


class Phase:
    """One rank's way through an ordered list of tasks (see the module): the fresh ones first, then those its
    launch's board frees, until the board says every task is done. Rank 0 of a launch (`scan`) writes the board."""

    def __init__(self, name: str, tasks: Sequence[str], claims: Claims, layout: RunLayout, attempt: str,
                 scan: Callable[[], Board] | None, backoff: Backoff):
        self.claims, self.scan, self.backoff = claims, scan, backoff
        self.fresh = Frontier(tasks, Hint(layout.frontier(name), claims.owner), claims.claim_first, claims.claimed)
        self.freed_hint = Hint(layout.freed(attempt, name), claims.owner)
        self.board = layout.board(attempt, name)

    def look(self) -> Board | None:
        return self.scan() if self.scan is not None else read_board(self.board)

    def freed(self, board: Board) -> Frontier:
        return Frontier(board.free, self.freed_hint, self.claims.try_claim, version=board.version)

    def work_through(self, work: Callable[[Iterator[Claim]], None],
                     sleep: Callable[[float], None] = time.sleep) -> None:
        """Passes of `work` over what this rank claims (each pass ends when there is nothing more to claim for now),
        waiting on the board between them."""
        work(iter(self.fresh))
        acted = None
        while (board := self.look()) is None or not board.done:
            if board is not None and board.free and board.version != acted:
                acted = board.version
                work(iter(self.freed(board)))
                self.backoff.reset()
            else:
                sleep(self.backoff.next())


def units_phase(layout: RunLayout, plan: Plan, claims: Claims, attempt: str, main: bool, backoff: Backoff) -> Phase:
    """The plan's blocks; once every unit is committed, rank 0's tail writes the duplicate pass's index. The tail's
    record of every block is made at its first look, once this rank has claimed all it could: nothing the size of the
    plan is held before the first unit (a pattern's plan holds nothing at all until then)."""
    blocks = plan.blocks()
    scan = None
    if main:
        def tail() -> TailScan:
            gather = IdsGather(layout, [unit.unit_id for unit in plan.units])
            return TailScan(claims, {block.task: [unit.unit_id for unit in block.units] for block in blocks},
                            gather.committed, layout.board(attempt, UNITS), gather.write_index)

        scan = at_first_look(tail)
    return Phase(UNITS, blocks.tasks, claims, layout, attempt, scan, backoff)


def at_first_look(make: Callable[[], TailScan]) -> Callable[[], Board]:
    """A tail scan made when it is first looked at."""
    made: list[TailScan] = []

    def look() -> Board:
        if not made:
            made.append(make())
        return made[0]()

    return look


def buckets_phase(layout: RunLayout, buckets: int, claims: Claims, attempt: str, main: bool,
                  backoff: Backoff) -> Phase:
    """The duplicate pass's buckets, each done once its result is committed."""
    tasks = [bucket_task(bucket) for bucket in range(buckets)]
    scan = None
    if main:
        scan = TailScan(claims, {task: [task] for task in tasks},
                        lambda task: layout.bucket_result(bucket_of_task(task)).exists(), layout.board(attempt, DEDUP))
    return Phase(DEDUP, tasks, claims, layout, attempt, scan, backoff)


def claimed_so_far(layout: RunLayout, phase: str = UNITS, tasks: Sequence[str] | None = None) -> int:
    """How many tasks of a phase's list (blocks of units, or buckets) were claimed, for a status report: its frontier's
    hint, and with the phase's `tasks` the claimed prefix's end found from there (a stat or two; the hint alone can be
    short: after a crash between a claim and its hint, or where a slower claimer wrote last). 0 once a complete run's
    claims are removed (read_board tells a launch's tail, its `done` the end). Writes nothing."""
    position = Hint(layout.frontier(phase), "status").read()
    if tasks is None:
        return position
    return end_of_prefix(tasks, lambda task: ever_claimed(layout.claims, task), position)


def claimed_units(layout: RunLayout, blocks: dict[str, Block], claimed: Iterable[Claim],
                  units: RankUnits | None = None) -> Iterator[tuple[WorkUnit, Claim]]:
    """The units of each block as it is claimed (the next block is claimed only once this one's units are handed
    out), but those committed already: by an earlier holder of the block, or before a restart. `units` counts them
    as this rank's claimed units."""
    for claim in claimed:
        todo = [unit for unit in blocks[claim.task].units if not layout.manifest(unit.unit_id).exists()]
        if units is not None:
            units.hold([unit.unit_id for unit in todo])
        for unit in todo:
            yield unit, claim
