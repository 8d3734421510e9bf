"""The run directory's layout: every path of a run, named here and nowhere else.

    <run>/.batchvlm                the marker: this folder is a batchvlm run's, written first
          config.yaml              the config that started the run
          fingerprint.json         what the run's outputs depend on; another one is refused
          units.json               the plan: inputs, the parameters that cut them, the work units
          lineage.json             a requeue run: where each record came from
          data/<unit>.<claim>.parquet        embedding rows of a unit, as one claim wrote them
                                             (<unit>.<claim>-<n>.parquet its n-th further file, where the rows
                                             outgrow output.shard_bytes)
          quarantine/<unit>.<claim>.parquet  quarantined records of that unit (and its further files, the same way)
          ids/<unit>.<claim>.parquet         (id, row, kind) of every record of that unit, by hash bucket
          manifest/<unit>.json     the unit's commit: counts, the files above, their sizes and sha256
          dedup/index.parquet      every committed unit's ids file and its buckets, gathered once for the duplicate pass
          dedup/<bucket>.json      a bucket of the duplicate pass committed; <bucket>.parquet its later occurrences
          ranks/claims/            the claims of every attempt on blocks of units and buckets, their holders'
                                   heartbeats (rundir.claims), and each list's frontier hint (rundir.frontier);
                                   ranks/<attempt>/ one launch's rank progress and its tail boards
          report/index.html        the failure report's page
          push.lock                held while batchvlm-push uploads the run: who pushes it, where to
          push.staging/            while it does, its copies of the data shards without their later occurrences
          _SUCCESS                 written last, once every unit and bucket is committed: the run's totals

Readers trust only what a manifest lists; a manifest names its files relative to the run (`data/<name>`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from batchvlm.rundir.durable import TMP_MARK

PART_MARK = "-"
"""Between a shard's claim token and the number of its further file (a token is hex and digits only)."""
DATA, QUARANTINE, IDS = "data", "quarantine", "ids"
"""The kinds of shard a unit writes, each in the folder of its name."""
SHARD_KINDS = (DATA, QUARANTINE, IDS)


@dataclass(frozen=True)
class RunLayout:
    root: Path

    # -- the run's own files ----------------------------------------------------------------------
    @property
    def marker(self) -> Path:
        return self.root / ".batchvlm"

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def fingerprint(self) -> Path:
        return self.root / "fingerprint.json"

    @property
    def plan(self) -> Path:
        return self.root / "units.json"

    @property
    def lineage(self) -> Path:
        return self.root / "lineage.json"

    @property
    def success(self) -> Path:
        return self.root / "_SUCCESS"

    @property
    def report_page(self) -> Path:
        return self.root / "report" / "index.html"

    @property
    def push_lock(self) -> Path:
        return self.root / "push.lock"

    @property
    def push_staging(self) -> Path:
        return self.root / "push.staging"

    # -- units: shards and manifests --------------------------------------------------------------
    @property
    def manifests(self) -> Path:
        return self.root / "manifest"

    def manifest(self, unit_id: str) -> Path:
        return self.manifests / f"{unit_id}.json"

    def unit_of(self, manifest: Path) -> str:
        """The unit a manifest file commits."""
        return manifest.stem

    def folder(self, kind: str) -> Path:
        return self.root / kind

    def shard(self, kind: str, unit_id: str, token: str, part: int = 0) -> Path:
        """The file of one kind that one claim on a unit writes (a claim's token keeps two holders apart); `part` n > 0
        names its n-th further file, where a unit's rows of that kind outgrow one file."""
        return self.folder(kind) / f"{unit_id}.{token}{f'{PART_MARK}{part}' if part else ''}.parquet"

    def manifest_draft(self, unit_id: str, token: str) -> Path:
        """The name a claim's manifest is written under before it is published as the unit's (durable.temporary_name
        of this)."""
        return self.manifests / f"{unit_id}.json.{token}"

    def claim_of(self, path: Path) -> tuple[str, str] | None:
        """(unit, claim token) of a file that a claim writes in the unit folders: a shard, a shard or manifest on its
        way to being published; None for any other name, which batchvlm never writes there."""
        name = path.name
        if TMP_MARK in name:
            name = name.removeprefix(".").split(TMP_MARK)[0]
        parts = name.rsplit(".", 2)
        if len(parts) != 3:
            return None
        if path.parent == self.manifests:
            unit, json_suffix, token = parts
            return (unit, token) if json_suffix == "json" else None
        unit, token, suffix = parts
        token = token.split(PART_MARK)[0]
        return (unit, token) if suffix == "parquet" and path.parent in self.unit_folders() else None

    def unit_folders(self) -> list[Path]:
        """The folders a unit's commit writes into."""
        return [self.folder(kind) for kind in SHARD_KINDS] + [self.manifests]

    def listed(self, name: str) -> Path:
        """A file as a manifest names it."""
        return self.root / name

    def name_of(self, path: Path) -> str:
        """How a manifest names a file of the run."""
        return path.relative_to(self.root).as_posix()

    # -- the duplicate pass -----------------------------------------------------------------------
    @property
    def dedup(self) -> Path:
        return self.root / "dedup"

    def bucket_result(self, bucket: int) -> Path:
        return self.dedup / f"{bucket:05d}.json"

    def bucket_duplicates(self, bucket: int) -> Path:
        return self.dedup / f"{bucket:05d}.parquet"

    @property
    def dedup_index(self) -> Path:
        return self.dedup / "index.parquet"

    def committed_buckets(self) -> list[Path]:
        """The commits of the buckets done so far (a listing of the duplicate pass's folder)."""
        return sorted(self.dedup.glob("*.json")) if self.dedup.is_dir() else []

    # -- ranks of the current attempt -------------------------------------------------------------
    @property
    def ranks(self) -> Path:
        return self.root / "ranks"

    @property
    def claims(self) -> Path:
        return self.ranks / "claims"

    def attempt(self, name: str) -> Path:
        return self.ranks / name

    def attempts(self) -> list[str]:
        """The launches whose state is here (one listing of ranks/, an entry per launch)."""
        if not self.ranks.is_dir():
            return []
        return sorted(path.name for path in self.ranks.iterdir() if path.is_dir() and path != self.claims)

    def rank_file(self, attempt: str, rank: int, kind: str) -> Path:
        return self.attempt(attempt) / f"rank-{rank:05d}.{kind}.json"

    def rank_files(self, attempt: str, kind: str) -> list[Path]:
        return sorted(self.attempt(attempt).glob(f"rank-*.{kind}.json"))

    def board(self, attempt: str, phase: str) -> Path:
        """What rank 0 of a launch last saw of a phase's tail: every other rank of the launch waits on this file."""
        return self.attempt(attempt) / f"{phase}.board.json"

    def freed(self, attempt: str, phase: str) -> Path:
        """The hint of how far the tasks on a launch's board have been handed out (rundir.frontier)."""
        return self.attempt(attempt) / f"{phase}.freed"

    def frontier(self, name: str) -> Path:
        """The hint of where the claimed prefix of an ordered list of tasks ends, shared by every attempt."""
        return self.claims / f"{name}.frontier"
