"""Verify a run directory against its own manifests: the exactly-once contract, checked from disk.

Every unit of `units.json` has a manifest; every file a manifest lists exists, has its sha256 and
its row count, and opens as Parquet; counts add up; no id is in the run twice; `_SUCCESS` totals
equal the manifests. Each problem names the unit (or file) it is about.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq

from batchvlm.sink import TMP_MARK, sha256_file


def verify_run(run_dir: Path) -> list[str]:
    problems: list[str] = []
    plan_file = run_dir / "units.json"
    if not plan_file.exists():
        return [f"{run_dir}: no units.json; not a batchvlm run directory, or it never started"]
    ids: Counter = Counter()
    totals = Counter()
    for entry in json.loads(plan_file.read_text()):
        unit = entry["unit_id"]
        manifest_file = run_dir / "manifest" / f"{unit}.json"
        if not manifest_file.exists():
            problems.append(f"unit {unit}: not committed (no manifest)")
            continue
        try:
            manifest = json.loads(manifest_file.read_text())
        except json.JSONDecodeError as error:
            problems.append(f"unit {unit}: manifest is not valid JSON ({error})")
            continue
        problems += _verify_unit(run_dir, unit, entry, manifest, ids)
        totals.update(records_in=manifest["records_in"], written=manifest["written"],
                      quarantined=manifest["quarantined"])
    problems += [f"id {record_id!r} appears {count} times in the run" for record_id, count in ids.items() if count > 1]
    problems += [f"{path.relative_to(run_dir)}: temporary file left behind" for path in run_dir.rglob(f"*{TMP_MARK}*")]
    success = run_dir / "_SUCCESS"
    if success.exists():
        summary = json.loads(success.read_text())
        for key in ("records_in", "written", "quarantined"):
            if summary.get(key) != totals[key]:
                problems.append(f"_SUCCESS: {key}={summary.get(key)} but the manifests add up to {totals[key]}")
    return problems


def _verify_unit(run_dir: Path, unit: str, entry: dict, manifest: dict, ids: Counter) -> list[str]:
    problems = []
    if manifest["records_in"] != entry["stop"] - entry["start"]:
        problems.append(f"unit {unit}: {manifest['records_in']} records in, the unit has {entry['stop'] - entry['start']} rows")
    if manifest["records_in"] != manifest["written"] + manifest["quarantined"]:
        problems.append(f"unit {unit}: records_in != written + quarantined")
    expected_rows = {"data": manifest["written"], "quarantine": manifest["quarantined"]}
    for kind, listed in manifest["files"].items():
        path = run_dir / listed["path"]
        if not path.exists():
            problems.append(f"unit {unit}: {listed['path']} is missing")
            continue
        if sha256_file(path) != listed["sha256"]:
            problems.append(f"unit {unit}: {listed['path']} does not match its sha256 in the manifest")
            continue
        try:
            table = pq.read_table(path, columns=["id"])
        except Exception as error:
            problems.append(f"unit {unit}: {listed['path']} does not open as Parquet ({error})")
            continue
        if table.num_rows != listed["rows"] or table.num_rows != expected_rows[kind]:
            problems.append(f"unit {unit}: {listed['path']} has {table.num_rows} rows, the manifest says {listed['rows']}")
        ids.update(table.column("id").to_pylist())
    return problems
