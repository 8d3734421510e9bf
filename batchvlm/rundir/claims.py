"""Work claiming through the run directory: exclusive, leased claims on named tasks.

A claim on task T is the file `T.<generation>`, published with a hard link (which fails if the
name exists, as O_EXCL does, and never shows a half-written file), which exactly one process can do.
Its holder keeps it alive through a per-process heartbeat file that a thread touches; a claim whose
holder's heartbeat is older than the lease is taken over by creating the next generation, again
exclusively, so of several ranks that see a dead holder one wins. The newest generation is the claim
that counts: a holder checks it still has it before it commits (fencing), and the commit itself is
exclusive (sink), so a holder that was only frozen never commits twice.

The claims outlive a job: a restart, or a second job on the same run directory, claims beside the
ones of earlier attempts, and takes over only what a dead holder held. Ages are compared between
two files' modification times: the holder's heartbeat and the reader's own, touched just before. Where
the file system sets them (NFS) clocks that differ between nodes do not matter; where the client does
(Lustre, GPFS), a heartbeat from a host whose clock is ahead is in the reader's future: it counts as
fresh from when the reader first sees it, for one lease at most (a live holder's next beat is seen
anew), and is logged once with the skew. A holder on this host whose process is gone is dead at once.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from batchvlm.rundir.durable import publish_exclusive

log = logging.getLogger("batchvlm")

ALIVE = "alive"
"""The claims folder's folder of heartbeats, a file per holder."""
AHEAD_S = 1.0
"""A heartbeat further than this in the reader's future comes from a host whose clock is ahead (closer is another
holder's beat between the reader's own and its stat)."""
LEASE_S = 120.0
"""runtime.lease_s's default: how old a heartbeat may be before its holder's claims are taken over."""


@dataclass(frozen=True)
class Claim:
    task: str
    generation: int
    owner: str

    @property
    def token(self) -> str:
        """Names the files this claim writes, so two holders of one task never write the same file."""
        return f"{self.owner.rsplit('-', 1)[-1]}{self.generation}"


def claim_file(folder: Path, task: str, generation: int) -> Path:
    return folder / f"{task}.{generation}"


def ever_claimed(folder: Path, task: str) -> bool:
    """Someone claimed the task once (its first generation exists): one stat, writing nothing (a reader's check)."""
    return claim_file(folder, task, 0).exists()


class Claims:
    """Claims of one process (`owner`) in a folder every rank sees. `clock` (the tests'): the time its heartbeats are
    set to and ages are read against; by default the file system's own, a heartbeat touched now."""

    def __init__(self, folder: Path, owner: str, lease_s: float, clock: Callable[[], float] | None = None):
        self.folder = folder
        self.owner = owner
        self.lease_s = lease_s
        self.clock = clock
        self.alive = folder / ALIVE
        self.alive.mkdir(parents=True, exist_ok=True)
        self._ahead: dict[str, tuple[float, float]] = {}  # holder -> (its beat from the future, when first seen)

    def _claim_file(self, task: str, generation: int) -> Path:
        return claim_file(self.folder, task, generation)

    def _heartbeat_file(self, owner: str) -> Path:
        return self.alive / owner

    def beat(self) -> None:
        """Touch the heartbeat; its first beat says where the holder runs."""
        heartbeat = self._heartbeat_file(self.owner)
        times = None if self.clock is None else (self.clock(),) * 2
        try:
            os.utime(heartbeat, times)
        except FileNotFoundError:
            heartbeat.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
            os.utime(heartbeat, times)

    def now(self) -> float:
        """The time every age is measured against: this process's heartbeat, touched now."""
        self.beat()
        return self._heartbeat_file(self.owner).stat().st_mtime

    def expired(self, owner: str, now: float | None = None) -> bool:
        """Every holder that `owner` names (a pattern like `<attempt>-rank00001-*` names one per attempt's rank) is
        dead: its heartbeat older than the lease, seen against this process's own fresh one (`now`, where the caller
        already has it), or its process gone from this host."""
        now = self.now() if now is None else now
        return all(self._age(path.name, beat, now) > self.lease_s or gone_from_this_host(path)
                   for path, beat in self._beats(owner))

    def _age(self, holder: str, beat: float, now: float) -> float:
        """How old a holder's heartbeat is at `now`. One from the future (its host's clock is ahead) is as old as the
        time since this process first saw it, so it stays fresh for one lease at most unless the holder beats again."""
        if beat <= now + AHEAD_S:
            return max(0.0, now - beat)
        seen = self._ahead.get(holder)
        if seen is None:
            log.warning("the heartbeat of %s is %.0f s ahead of this host's clock (its host's clock is ahead, or this "
                        "one's behind): it counts as alive for one lease (%g s) after each beat is first seen here",
                        holder, beat - now, self.lease_s)
        if seen is None or seen[0] != beat:
            seen = self._ahead[holder] = (beat, now)
        return now - seen[1]

    def _beats(self, owner: str) -> list[tuple[Path, float]]:
        return _heartbeats(self.alive, owner)

    def alive_holders(self) -> list[str]:
        """The holders of every attempt whose heartbeats are live."""
        now = self.now()
        return [path.name for path, _ in self._beats("*") if not self.expired(path.name, now)]

    def claim_of(self, task: str, token: str) -> Claim | None:
        """The claim on `task` whose files carry `token`, if it was made here."""
        generation = 0
        while (claim := self._read(task, generation)) is not None:
            if claim.token == token:
                return claim
            generation += 1
        return None

    def dead(self, task: str, token: str, committed_token: str | None) -> bool:
        """The claim whose files carry `token` can never commit and nobody is still writing for it: it is fenced (a
        later claim on the task, or the task committed by another claim) and its holder's lease has expired."""
        claim = self.claim_of(task, token)
        if claim is None:
            return committed_token is not None and committed_token != token
        fenced = not self.holds(claim) or (committed_token is not None and committed_token != token)
        return fenced and self.expired(claim.owner)

    def _read(self, task: str, generation: int) -> Claim | None:
        try:
            owner = json.loads(self._claim_file(task, generation).read_text())["owner"]
        except FileNotFoundError:
            return None
        return Claim(task, generation, owner)

    def _newest(self, task: str) -> tuple[int, str] | None:
        """The newest generation of a task's claim and its owner, or None if it was never claimed."""
        newest, generation = None, 0
        while (claim := self._read(task, generation)) is not None:
            newest, generation = (claim.generation, claim.owner), generation + 1
        return newest

    def _create(self, task: str, generation: int) -> Claim | None:
        """Publish the claim file whole or not at all (durable.publish_exclusive: written beside it, then
        hard-linked to its name, which fails if the name exists, and no reader ever sees it half written)."""
        final = self._claim_file(task, generation)
        tmp = final.with_name(f".{final.name}.{self.owner}.{os.getpid()}")  # workers of one rank share the owner
        tmp.write_text(json.dumps({"owner": self.owner, "generation": generation}))
        if not publish_exclusive(tmp, final):
            return None
        return Claim(task, generation, self.owner)

    def try_claim(self, task: str) -> Claim | None:
        """Claim a task that nobody holds, or take over one whose holder's lease expired."""
        newest = self._newest(task)
        if newest is None:
            return self._create(task, 0)
        generation, owner = newest
        if owner == self.owner or not self.expired(owner):
            return None
        return self._create(task, generation + 1)

    def claimable(self, task: str, now: float | None = None) -> bool:
        """Nobody holds the task, or its holder's lease expired (so `try_claim` may win it)."""
        newest = self._newest(task)
        return newest is None or (newest[1] != self.owner and self.expired(newest[1], now))

    def claimed(self, task: str) -> bool:
        """Someone claimed the task once (its first generation exists): one stat."""
        return ever_claimed(self.folder, task)

    def claim_first(self, task: str) -> Claim | None:
        """The task's first claim, or None where it was ever claimed (by anyone, in any attempt)."""
        return self._create(task, 0)

    def holds(self, claim: Claim) -> bool:
        """Still the newest claim on its task (nobody took it over)."""
        return not self._claim_file(claim.task, claim.generation + 1).exists()


class Heartbeat:
    """Touches the owner's heartbeat file every lease/4 seconds on a daemon thread. `wait(seconds)` waits that long or
    until stopped (True then); the tests' moves their clock instead."""

    def __init__(self, claims: Claims, wait: Callable[[float], bool] | None = None):
        self.claims = claims
        self.stopped = threading.Event()
        self.wait = wait or self.stopped.wait
        claims.beat()
        self.thread = threading.Thread(target=self._run, name="batchvlm-heartbeat", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.wait(self.claims.lease_s / 4) and not self.stopped.is_set():
            self.claims.beat()

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join()


def owner_name(attempt: str, rank: int) -> str:
    """A holder of claims: its attempt (one launch of the job), its rank, and a nonce that names its files."""
    return f"{rank_owners(attempt, rank)[:-1]}{uuid.uuid4().hex[:8]}"


def rank_owners(attempt: str, rank: int) -> str:
    """The pattern of the holders of one rank of an attempt."""
    return f"{attempt}-rank{rank:05d}-*"


def rank_of_owner(owner: str) -> tuple[str, int] | None:
    """(attempt, rank) of a holder that owner_name named; None for any other name."""
    parts = owner.rsplit("-", 2)
    if len(parts) != 3 or not parts[1].startswith("rank") or not parts[1][4:].isdigit():
        return None
    return parts[0], int(parts[1][4:])


@dataclass(frozen=True)
class Beat:
    """A holder's last heartbeat, for a status: when (the file system's time) and whether its process is known to
    be gone (it ran on this host)."""

    owner: str
    at: float
    gone: bool


def last_beats(folder: Path) -> list[Beat]:
    """Every holder's last heartbeat in a claims folder: one listing of the heartbeats, a stat each (and a read of
    each that may have run on this host)."""
    return [Beat(path.name, at, gone_from_this_host(path)) for path, at in _heartbeats(folder / ALIVE, "*")]


def _heartbeats(alive: Path, owner: str) -> list[tuple[Path, float]]:
    """(heartbeat file, its modification time) of each holder `owner` names (a name or a pattern); one gone meanwhile
    is left out."""
    found = []
    for path in alive.glob(owner):
        try:
            found.append((path, path.stat().st_mtime))
        except FileNotFoundError:
            continue
    return found


def gone_from_this_host(heartbeat: Path) -> bool:
    """The holder ran on this host and its process is gone (a restart need not wait out a dead process's lease)."""
    try:
        where = json.loads(heartbeat.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return False
    if where.get("host") != socket.gethostname():
        return False
    try:
        os.kill(where["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False
