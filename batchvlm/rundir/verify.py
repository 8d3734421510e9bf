"""Verify a run directory against its own manifests: the exactly-once contract, checked from disk.

Every unit of the plan has a manifest; every file a manifest lists exists, has its sha256 and its row
count, and opens as Parquet; a unit's ids file holds exactly the ids of its shards; counts add up; no
file is left that no manifest lists; and, bucket by bucket (one bucket's ids in memory at a time), no
id is in the run twice but the later occurrences that the duplicate pass listed, which must be exactly
those. `_SUCCESS` totals equal the manifests'. Each problem names the unit (or file) it is about.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq

from batchvlm.rundir.dedup import FOLDER, bucket_results, duplicate_rows, find_duplicates
from batchvlm.rundir.durable import TMP_MARK, sha256_file
from batchvlm.rundir.sink import FOLDERS
from batchvlm.rundir.workunits import PLAN_FILE, read_plan


def verify_run(run_dir: Path) -> list[str]:
    if not (run_dir / PLAN_FILE).exists():
        return [f"{run_dir}: no {PLAN_FILE}; not a batchvlm run directory, or it never started"]
    plan = read_plan(run_dir)
    problems: list[str] = []
    manifests, totals, listed = [], Counter(), set()
    for unit in plan.units:
        manifest_file = run_dir / "manifest" / f"{unit.unit_id}.json"
        if not manifest_file.exists():
            problems.append(f"unit {unit.unit_id}: not committed (no manifest)")
            continue
        try:
            manifest = json.loads(manifest_file.read_text())
        except json.JSONDecodeError as error:
            problems.append(f"unit {unit.unit_id}: manifest is not valid JSON ({error})")
            continue
        unit_problems = _verify_unit(run_dir, unit, manifest)
        problems += unit_problems
        if not unit_problems:
            manifests.append(manifest)
        listed |= {entry["path"] for entry in manifest["files"].values()}
        totals.update(records_in=manifest["records_in"], written=manifest["written"],
                      quarantined=manifest["quarantined"])
    problems += [f"{path.relative_to(run_dir)}: temporary file left behind" for path in run_dir.rglob(f"*{TMP_MARK}*")]
    problems += [f"{name}/{path.name}: no manifest lists it" for name in FOLDERS if name != "manifest"
                 for path in sorted((run_dir / name).glob("*.parquet")) if f"{name}/{path.name}" not in listed]
    success_file = run_dir / "_SUCCESS"
    if success_file.exists() and not problems:
        problems += _verify_duplicates(run_dir, plan, manifests)
        summary = json.loads(success_file.read_text())
        moved = summary.get("duplicates", {}).get("in_data", 0)
        expected = {"records_in": totals["records_in"], "written": totals["written"] - moved,
                    "quarantined": totals["quarantined"] + moved}
        for key, value in expected.items():
            if summary.get(key) != value:
                problems.append(f"_SUCCESS: {key}={summary.get(key)} but the manifests add up to {value}")
    return problems


def _verify_unit(run_dir: Path, unit, manifest: dict) -> list[str]:
    problems, name = [], unit.unit_id
    if unit.num_rows is not None and manifest["records_in"] != unit.num_rows:
        problems.append(f"unit {name}: {manifest['records_in']} records in, the unit has {unit.num_rows} rows")
    if manifest["records_in"] != manifest["written"] + manifest["quarantined"]:
        problems.append(f"unit {name}: records_in != written + quarantined")
    expected_rows = {"data": manifest["written"], "quarantine": manifest["quarantined"],
                     "ids": manifest["records_in"]}
    ids: dict[str, Counter] = {}
    for kind, rows in expected_rows.items():
        entry = manifest["files"].get(kind)
        if entry is None:
            if rows:
                problems.append(f"unit {name}: {rows} {kind} rows but no {kind} file")
            continue
        path = run_dir / entry["path"]
        if not path.exists():
            problems.append(f"unit {name}: {entry['path']} is missing")
            continue
        if sha256_file(path) != entry["sha256"]:
            problems.append(f"unit {name}: {entry['path']} does not match its sha256 in the manifest")
            continue
        try:
            table = pq.read_table(path, columns=["id"])
        except Exception as error:
            problems.append(f"unit {name}: {entry['path']} does not open as Parquet ({error})")
            continue
        if table.num_rows != entry["rows"] or table.num_rows != rows:
            problems.append(f"unit {name}: {entry['path']} has {table.num_rows} rows, the manifest says {entry['rows']}")
        ids[kind] = Counter(table.column("id").to_pylist())
    if not problems and ids.get("ids", Counter()) != ids.get("data", Counter()) + ids.get("quarantine", Counter()):
        problems.append(f"unit {name}: its ids file does not hold the ids of its shards")
    return problems


def _verify_duplicates(run_dir: Path, plan, manifests: list[dict]) -> list[str]:
    """Bucket by bucket: the later occurrences found again must be exactly those the run listed.
    `manifests` are in plan order, as `verify_run` reads them."""
    locations = {item.name: item.location for item in plan.inputs}
    results = bucket_results(run_dir, plan.dedup_buckets)
    problems = [f"{FOLDER}/{bucket:05d}.json: the duplicate pass did not commit this bucket"
                for bucket, result in enumerate(results) if result is None]
    listed = Counter((d["id"], d["unit"], d["row"]) for d in duplicate_rows(run_dir))
    found = Counter()
    for bucket in range(plan.dedup_buckets):
        found.update((d["id"], d["unit"], d["row"]) for d in find_duplicates(run_dir, manifests, bucket, locations))
    if found != listed:
        missing, extra = found - listed, listed - found
        problems.append(f"ids in the run twice but not listed as duplicates: {sorted(missing)[:5]}" if missing else
                        f"listed as duplicates but not repeated: {sorted(extra)[:5]}")
    return problems
