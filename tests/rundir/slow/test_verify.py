"""verify: the exactly-once contract checked from disk, each problem named by its unit or file."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
from conftest import run_job_command, summary_in_process
from test_dedup import _write

from batchvlm.rundir.verify import verify_run

# runs of the job
pytestmark = pytest.mark.slow


def verify(run_dir) -> subprocess.CompletedProcess:
    return run_job_command("verify", f"run_dir={run_dir}", timeout=120)


def test_verify_passes_a_good_run_with_its_counts_and_names_the_unit_of_a_truncated_shard(demo_run, tmp_path):
    good = verify(demo_run)
    assert good.returncode == 0
    assert "4 units, 21 records (18 written, 3 quarantined)" in good.stdout and " bytes; every unit" in good.stdout
    copy = tmp_path / "copy"
    shutil.copytree(demo_run, copy)
    shard = sorted((copy / "data").glob("*.parquet"))[1]
    shard.write_bytes(shard.read_bytes()[:-1])
    result = verify(copy)
    assert result.returncode == 1 and f"unit {shard.name.split('.')[0]}:" in result.stdout  # <unit>.<claim>.parquet


def test_verify_names_the_unit_whose_manifest_checksum_disagrees(demo_run, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(demo_run, copy)
    manifest_file = next(m for m in sorted((copy / "manifest").glob("*.json"))
                         if "quarantine" in json.loads(m.read_text())["files"])
    manifest = json.loads(manifest_file.read_text())
    manifest["files"]["quarantine"][0]["sha256"] = "0" * 64
    manifest_file.write_text(json.dumps(manifest))
    problems = verify_run(copy)  # what the command prints, a FAIL line each, before its exit 1 (tested above)
    assert problems and any(f"unit {manifest_file.stem}: quarantine/" in problem for problem in problems)


def test_verify_names_the_unit_of_a_manifest_that_is_not_one_and_goes_on(demo_run, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(demo_run, copy)
    manifest_file = sorted((copy / "manifest").glob("*.json"))[0]
    manifest_file.write_text("{}")
    problems = verify_run(copy)  # a list, not a traceback: the command prints each as a FAIL line and exits 1
    assert problems and all(isinstance(problem, str) for problem in problems)
    assert any(problem.startswith(f"unit {manifest_file.stem}: ") and "not a batchvlm manifest" in problem
               for problem in problems)


def test_verify_catches_a_duplicate_that_the_run_did_not_list(tmp_path):
    _write(tmp_path)
    summary = summary_in_process(tmp_path, "dups", "dataset=parquet", f"dataset.path={tmp_path}/*.parquet",
                                 "runtime.num_workers=0")  # what it writes: in this process
    assert summary is not None and summary["complete"]
    run_dir = tmp_path / "dups"
    assert verify_run(run_dir) == []
    for listing in (run_dir / "dedup").glob("*.parquet"):
        listing.unlink()
    for result_file in (run_dir / "dedup").glob("*.json"):
        result_file.write_text(json.dumps({**json.loads(result_file.read_text()), "file": None}))
    problems = verify_run(run_dir)
    assert any("not listed as duplicates" in problem for problem in problems), problems
