"""Work claiming through the run directory: exclusive, leased claims on named tasks.

A claim on task T is the file `T.<generation>`, published with a hard link (which fails if the
name exists, as O_EXCL does, and never shows a half-written file), which exactly one process can do. Its holder keeps it alive through a per-process heartbeat file that a thread
touches; a claim whose holder's heartbeat is older than the lease is taken over by creating the
next generation, again exclusively, so of several ranks that see a dead holder one wins. The
newest generation is the claim that counts: a holder checks it still has it before it commits
(fencing), and the commit itself is exclusive (sink), so a holder that was only frozen never
commits twice.

Ages are compared between two files' modification times, both set by the file system that holds
the run directory, so clocks that differ between nodes do not matter.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from batchvlm.rundir.durable import publish_exclusive


@dataclass(frozen=True)
class Claim:
    task: str
    generation: int
    owner: str

    @property
    def token(self) -> str:
        """Names the files this claim writes, so two holders of one task never write the same file."""
        return f"{self.owner.rsplit('-', 1)[-1]}{self.generation}"


class Claims:
    """Claims of one process (`owner`) in a folder every rank sees."""

    def __init__(self, folder: Path, owner: str, lease_s: float):
        self.folder = folder
        self.owner = owner
        self.lease_s = lease_s
        self.alive = folder / "alive"
        self.alive.mkdir(parents=True, exist_ok=True)

    def _claim_file(self, task: str, generation: int) -> Path:
        return self.folder / f"{task}.{generation}"

    def _heartbeat_file(self, owner: str) -> Path:
        return self.alive / owner

    def beat(self) -> None:
        self._heartbeat_file(self.owner).touch()

    def expired(self, owner: str) -> bool:
        """The owner's heartbeat (the newest, for a pattern like `rank00001-*`) is older than the lease, seen
        against this process's own fresh one."""
        self.beat()
        beats = [path.stat().st_mtime for path in self.alive.glob(owner)]
        return not beats or self._heartbeat_file(self.owner).stat().st_mtime - max(beats) > self.lease_s

    def _newest(self, task: str) -> tuple[int, str] | None:
        """The newest generation of a task's claim and its owner, or None if it was never claimed."""
        generation, owner = -1, None
        while True:
            try:
                owner = json.loads(self._claim_file(task, generation + 1).read_text())["owner"]
            except FileNotFoundError:
                return None if owner is None else (generation, owner)
            generation += 1

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

    def claimable(self, task: str) -> bool:
        """Nobody holds the task, or its holder's lease expired (so `try_claim` may win it)."""
        newest = self._newest(task)
        return newest is None or (newest[1] != self.owner and self.expired(newest[1]))

    def holds(self, claim: Claim) -> bool:
        """Still the newest claim on its task (nobody took it over)."""
        return not self._claim_file(claim.task, claim.generation + 1).exists()


class Heartbeat:
    """Touches the owner's heartbeat file every lease/4 seconds on a daemon thread."""

    def __init__(self, claims: Claims):
        self.claims = claims
        self.stopped = threading.Event()
        claims.beat()
        self.thread = threading.Thread(target=self._run, name="batchvlm-heartbeat", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped.wait(self.claims.lease_s / 4):
            self.claims.beat()

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join()


def owner_name(rank: int, nonce: str) -> str:
    return f"rank{rank:05d}-{nonce}"
