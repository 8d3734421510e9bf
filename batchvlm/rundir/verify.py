"""Verify a run directory against its own manifests: the exactly-once contract, checked from disk.

Every unit of the plan has a manifest; every file a manifest lists exists, has its sha256 and its row
count, and opens as Parquet; a unit's ids file holds exactly the ids of its shards; counts add up; no
file is left that no manifest lists; and, bucket by bucket (one bucket's ids in memory at a time), no
id is in the run twice but the later occurrences that the duplicate pass listed, which must be exactly
those. The run's totals, once written, equal the manifests'. Each problem names the unit (or file) it is about.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

from batchvlm.format.schema import FormatError
from batchvlm.rundir.dedup import UnitIds, bucket_results, committed_results, duplicate_rows, find_duplicates
from batchvlm.rundir.durable import TMP_MARK, DamagedMetadata, read_json, sha256_file
from batchvlm.rundir.layout import DATA, IDS, QUARANTINE, SHARD_KINDS, RunLayout
from batchvlm.rundir.manifest import Listing, Manifest, ManifestError, RunTotals, all_manifests, orphans, unit_manifest
from batchvlm.rundir.workunits import read_plan
from batchvlm.rundir.upgrade import check_run_format


@dataclass(frozen=True)
class RunCounts:
    """What a verified run holds."""

    units: int
    records_in: int
    written: int
    quarantined: int
    files: int
    bytes: int

    def __str__(self) -> str:
        return (f"{self.units:,} units, {self.records_in:,} records ({self.written:,} written, {self.quarantined:,} "
                f"quarantined), {self.files:,} files, {self.bytes:,} bytes")


def run_counts(run_dir: Path) -> RunCounts:
    """The counts of a run from its manifests and committed duplicate buckets (RunTotals), with its files."""
    layout = RunLayout(run_dir)
    totals = RunTotals.of(all_manifests(layout), committed_results(layout))
    return RunCounts(totals.units_committed, totals.records_in, totals.written, totals.quarantined, totals.files,
                     totals.bytes)


def verify_run(run_dir: Path) -> list[str]:
    layout = RunLayout(run_dir)
    if not layout.plan.exists():
        return [f"{run_dir}: no {layout.name_of(layout.plan)}; not a batchvlm run directory, or it never started"]
    try:
        check_run_format(layout)
        return _verify(layout)
    except FormatError as error:
        return [str(error)]
    except DamagedMetadata as error:  # the plan, the totals or a bucket's commit: what is checked against is damaged
        return [str(error)]


def _verify(layout: RunLayout) -> list[str]:
    plan = read_plan(layout)
    problems: list[str] = []
    manifests, good = [], []
    for unit in plan.units:
        try:
            manifest = unit_manifest(layout, unit.unit_id)
        except ManifestError as error:
            problems.append(f"unit {unit.unit_id}: {error}")
            continue
        if manifest is None:
            problems.append(f"unit {unit.unit_id}: not committed (no manifest)")
            continue
        manifests.append(manifest)
        unit_problems = _verify_unit(layout, unit, manifest)
        problems += unit_problems
        if not unit_problems:
            good.append(manifest)
    left = sorted(set(orphans(layout, manifests)) | set(layout.root.rglob(f"*{TMP_MARK}*")))
    problems += [f"{layout.name_of(path)}: " + ("temporary file left behind" if TMP_MARK in path.name else
                                                "no manifest lists it") for path in left]
    if layout.success.exists() and not problems:
        problems += _verify_duplicates(layout, plan, good)
        summary = read_json(layout.success)
        totals = RunTotals.of(manifests, bucket_results(layout, plan.dedup_buckets))
        for key in ("records_in", "written", "quarantined"):
            if summary.get(key) != getattr(totals, key):
                problems.append(f"{layout.name_of(layout.success)}: {key}={summary.get(key)} but the manifests add "
                                f"up to {getattr(totals, key)}")
    return problems


def _verify_unit(layout: RunLayout, unit, manifest: Manifest) -> list[str]:
    problems, name = [], unit.unit_id
    if unit.num_rows is not None and manifest.records_in != unit.num_rows:
        problems.append(f"unit {name}: {manifest.records_in} records in, the unit has {unit.num_rows} rows")
    if manifest.records_in != manifest.written + manifest.quarantined:
        problems.append(f"unit {name}: records_in != written + quarantined")
    ids: dict[str, Counter] = {}
    for kind in SHARD_KINDS:
        rows = manifest.rows_of(kind)
        listings = manifest.shards(kind)
        if not listings:
            if rows:
                problems.append(f"unit {name}: {rows} {kind} rows but no {kind} file")
            continue
        ids[kind] = Counter()
        for entry in listings:
            found = _listed_ids(layout, name, entry)
            if isinstance(found, str):
                problems.append(found)
            else:
                ids[kind].update(found)
        if not problems and sum(entry.rows for entry in listings) != rows:
            problems.append(f"unit {name}: its {kind} files list {sum(entry.rows for entry in listings)} rows, its "
                            f"counts say {rows}")
    if not problems and ids.get(IDS, Counter()) != ids.get(DATA, Counter()) + ids.get(QUARANTINE, Counter()):
        problems.append(f"unit {name}: its ids file does not hold the ids of its shards")
    return problems


def _listed_ids(layout: RunLayout, name: str, entry: Listing) -> list[str] | str:
    """The ids of one listed file, or the problem with it: missing, another sha256, not Parquet, other rows."""
    path = layout.listed(entry.path)
    if not path.exists():
        return f"unit {name}: {entry.path} is missing"
    if sha256_file(path) != entry.sha256:
        return f"unit {name}: {entry.path} does not match its sha256 in the manifest"
    try:
        table = pq.read_table(path, columns=["id"])
    except Exception as error:
        return f"unit {name}: {entry.path} does not open as Parquet ({error})"
    if table.num_rows != entry.rows:
        return f"unit {name}: {entry.path} has {table.num_rows} rows, the manifest says {entry.rows}"
    return table.column("id").to_pylist()


def _verify_duplicates(layout: RunLayout, plan, manifests: list[Manifest]) -> list[str]:
    """Bucket by bucket: the later occurrences found again must be exactly those the run listed.
    `manifests` are in plan order, as `verify_run` reads them."""
    locations = plan.locations()
    results = bucket_results(layout, plan.dedup_buckets)
    problems = [f"{layout.name_of(layout.bucket_result(bucket))}: the duplicate pass did not commit this bucket"
                for bucket, result in enumerate(results) if result is None]
    listed = Counter((d["id"], d["unit"], d["row"]) for d in duplicate_rows(layout))
    units = [UnitIds.of(manifest) for manifest in manifests]
    found = Counter()
    for bucket in range(plan.dedup_buckets):
        found.update((d["id"], d["unit"], d["row"]) for d in find_duplicates(layout, units, bucket, locations))
    if found != listed:
        missing, extra = found - listed, listed - found
        problems.append(f"ids in the run twice but not listed as duplicates: {sorted(missing)[:5]}" if missing else
                        f"listed as duplicates but not repeated: {sorted(extra)[:5]}")
    return problems
