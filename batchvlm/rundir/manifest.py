"""Manifests: a unit's commit record, read in this one place, and what follows from the set of them.

A unit is committed once its manifest exists; the manifest lists the unit's files (data, quarantine, ids) with
their rows, bytes and sha256: one or more files of each kind (a kind's rows are cut into files of at most
output.shard_bytes), in row order. Readers, resume and verify trust only listed files: `orphans` is the one rule for
what no manifest lists, and `RunTotals` the one count of a run, with the later occurrences of an id that the
duplicate pass found in data shards counted as quarantined (readers leave them out).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from batchvlm.rundir.durable import TMP_MARK, sha256_file
from batchvlm.rundir.layout import DATA, IDS, QUARANTINE, RunLayout


class ManifestError(ValueError):
    """A manifest that does not read as one: the message names the file and what is wrong."""


class DamagedFile(RuntimeError):
    """A file a manifest lists is missing, or not what the manifest recorded: the message names it."""


@dataclass(frozen=True)
class Listing:
    """One file of a unit, as its manifest lists it."""

    path: str  # relative to the run directory (RunLayout.listed)
    rows: int
    bytes: int
    sha256: str
    buckets: dict[str, int] | None = None  # the ids file: hash bucket -> its row group


@dataclass(frozen=True)
class Manifest:
    unit: str
    source: str
    start: int
    stop: int | None
    records_in: int
    written: int
    quarantined: int
    checks: dict[str, int]
    files: dict[str, list[Listing]]  # kind -> its files, in row order
    rank: int
    claim: str
    fallbacks: dict[str, int] = field(default_factory=dict)  # images redone on the CPU path, by check
    parity: dict[str, int] = field(default_factory=dict)  # the parity sample: checked_images, failed_images

    @classmethod
    def from_json(cls, raw: object, path: Path) -> Manifest:
        try:
            files = {kind: [Listing(**listing) for listing in listings] for kind, listings in raw["files"].items()}
            return cls(**{**raw, "files": files})
        except (TypeError, KeyError, AttributeError) as error:
            raise ManifestError(f"{path}: not a batchvlm manifest ({type(error).__name__}: {error})") from None

    def to_json(self) -> dict:
        return {**asdict(self), "files": {kind: [_without_none(asdict(listing)) for listing in listings]
                                          for kind, listings in self.files.items()}}

    def shards(self, kind: str) -> list[Listing]:
        """The unit's files of `kind`, in row order (none where it has no record of that kind)."""
        return self.files.get(kind, [])

    def listings(self) -> list[Listing]:
        """Every file the unit's commit lists."""
        return [listing for listings in self.files.values() for listing in listings]

    @property
    def preprocess(self) -> dict:
        """The unit's preprocessing counts, in the form pipeline.preprocess.merged_stats adds up."""
        return {"fallbacks": self.fallbacks, "parity": self.parity}

    def rows_of(self, kind: str) -> int:
        """The rows the files of `kind` hold together: one per record written, quarantined, or read (the ids file)."""
        return {DATA: self.written, QUARANTINE: self.quarantined, IDS: self.records_in}[kind]


def _without_none(listing: dict) -> dict:
    return {key: value for key, value in listing.items() if value is not None}


def read_manifest(path: Path) -> Manifest:
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ManifestError(f"{path}: not valid JSON ({error})") from None
    return Manifest.from_json(raw, path)


def unit_manifest(layout: RunLayout, unit_id: str) -> Manifest | None:
    """The unit's manifest, or None where the unit is not committed."""
    path = layout.manifest(unit_id)
    return read_manifest(path) if path.exists() else None


def committed_units(layout: RunLayout) -> set[str]:
    """The units with a manifest: one listing of the manifest folder."""
    if not layout.manifests.is_dir():
        return set()
    return {layout.unit_of(path) for path in layout.manifests.glob("*.json")}


def all_manifests(layout: RunLayout) -> list[Manifest]:
    """Every manifest of the run, by unit name."""
    return [read_manifest(layout.manifest(unit)) for unit in sorted(committed_units(layout))]


def manifests_in_order(layout: RunLayout, unit_ids: Iterable[str]) -> list[Manifest | None]:
    """Each unit's manifest in the order given (the plan's, which decides which occurrence of an id is the first),
    None where the unit is not committed."""
    return [unit_manifest(layout, unit_id) for unit_id in unit_ids]


def listed_shards(layout: RunLayout, kind: str = DATA) -> list[tuple[str, Path]]:
    """(unit, file) of every shard of `kind` that a manifest lists, by unit, a unit's files in row order: the only ones
    a reader may trust. A unit with no record of that kind has no such shard."""
    return [(manifest.unit, layout.listed(listing.path)) for manifest in all_manifests(layout)
            for listing in manifest.shards(kind)]


def checked_shards(layout: RunLayout, kind: str = DATA, checksums: bool = False) -> list[tuple[str, Path]]:
    """listed_shards, each at the size its manifest recorded (and of its sha256, with `checksums`), else
    DamagedFile: a reader never reads a committed file that changed since."""
    return [(manifest.unit, checked(layout, listing, checksums)) for manifest in all_manifests(layout)
            for listing in manifest.shards(kind)]


def checked(layout: RunLayout, listing: Listing, checksums: bool = False) -> Path:
    """A listed file, at the size its manifest recorded (and of its sha256, with `checksums`), else DamagedFile."""
    path = layout.listed(listing.path)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise DamagedFile(f"{path} is missing; its manifest lists it (verify the run, or rerun it)") from None
    if size != listing.bytes:
        raise DamagedFile(f"{path} has {size} bytes, its manifest says {listing.bytes} (verify the run, or rerun "
                          "it: the unit is redone)")
    if checksums and sha256_file(path) != listing.sha256:
        raise sha256_differs(path)
    return path


def sha256_differs(path: Path) -> DamagedFile:
    """The refusal of a listed file whose bytes are not the ones its manifest's sha256 names (however it was hashed)."""
    return DamagedFile(f"{path} does not match its sha256 in the manifest")


def listed_files(manifests: Iterable[Manifest]) -> set[str]:
    return {listing.path for manifest in manifests for listing in manifest.listings()}


def orphans(layout: RunLayout, manifests: Iterable[Manifest]) -> list[Path]:
    """What crashed or outrun holders left in the unit folders: temporary files, and shards no manifest lists. No
    reader trusts them; their units are redone (or were committed by another holder)."""
    listed = listed_files(manifests)
    found = []
    for folder in layout.unit_folders():
        if not folder.is_dir():
            continue
        is_shard_folder = folder != layout.manifests
        found += [path for path in sorted(folder.iterdir())
                  if TMP_MARK in path.name or (is_shard_folder and layout.name_of(path) not in listed)]
    return found


@dataclass(frozen=True)
class RunTotals:
    """The counts of a run from its manifests and its committed duplicate buckets: records_in == written +
    quarantined, with the later occurrences of an id found in data shards moved from written to quarantined under
    source.duplicate_id."""

    units_committed: int
    records_in: int
    written: int
    quarantined: int
    by_check: dict[str, int]
    later_occurrences: int
    duplicates_in_data: int
    files: int  # the files the manifests list (data, quarantine, ids)
    bytes: int  # their bytes

    @classmethod
    def of(cls, manifests: list[Manifest], buckets: list[dict | None]) -> RunTotals:
        moved = sum(result["in_data"] for result in buckets if result)
        by_check = sum((Counter(manifest.checks) for manifest in manifests), Counter())
        if moved:
            by_check["source.duplicate_id"] += moved
        return cls(units_committed=len(manifests), records_in=sum(m.records_in for m in manifests),
                   written=sum(m.written for m in manifests) - moved,
                   quarantined=sum(m.quarantined for m in manifests) + moved, by_check=dict(sorted(by_check.items())),
                   later_occurrences=sum(result["duplicates"] for result in buckets if result),
                   duplicates_in_data=moved, files=sum(len(m.listings()) for m in manifests),
                   bytes=sum(listing.bytes for m in manifests for listing in m.listings()))
