"""Many processes, exactly once: accelerate launch, kills at every stage, resume, verify."""

from __future__ import annotations

import json
import subprocess

import pyarrow.parquet as pq
import pytest

from batchvlm.demo import demo_rows
from batchvlm.rundir.verify import verify_run
from conftest import REPO, accelerate_command, refused_in_process, run_embed, summary_in_process

INPUT_IDS = sorted(row["id"] for row in demo_rows())

# accelerate launch, kills and restarts of the job
pytestmark = pytest.mark.slow


def rows_of(run_dir, kind="data") -> dict[str, dict]:
    return {row["id"]: row for path in sorted((run_dir / kind).glob("*.parquet"))
            for row in pq.read_table(path).to_pylist()}


def all_ids(run_dir) -> list[str]:
    return sorted(list(rows_of(run_dir, "data")) + list(rows_of(run_dir, "quarantine")))


def assert_exactly_once(run_dir, clean_rows):
    assert verify_run(run_dir) == []
    ids = [r["id"] for kind in ("data", "quarantine") for p in (run_dir / kind).glob("*.parquet")
           for r in pq.read_table(p, columns=["id"]).to_pylist()]
    assert sorted(ids) == INPUT_IDS  # every id once, none twice
    assert not [p for p in run_dir.rglob("*") if ".tmp-" in p.name]
    assert rows_of(run_dir) == clean_rows  # embeddings identical to an uninterrupted single-process run
    assert (run_dir / "_SUCCESS").exists()


@pytest.fixture(scope="module")
def clean_rows(demo_run):
    return rows_of(demo_run)


def test_two_processes_under_accelerate_split_the_work_and_match_one_process(tmp_path, clean_rows):
    command = accelerate_command(f"output.root={tmp_path}", "run_name=two", "dataset.unit_records=3",
                                 "runtime.num_workers=1")
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    run_dir = tmp_path / "two"
    ranks = {json.loads(p.read_text())["rank"] for p in (run_dir / "manifest").glob("*.json")}
    assert ranks == {0, 1}  # both ranks committed units
    assert (run_dir / "embed.rank0.log").exists() and (run_dir / "embed.rank1.log").exists()
    assert result.stdout.count("records in: 21") == 1  # one summary for the whole job, from rank 0
    assert_exactly_once(run_dir, clean_rows)


KILLS = ["crash.decode=4", "crash.encode=2", "crash.commit.before_rename=3", "crash.commit.before_manifest=2",
         "crash.finish.before_success=1"]


def test_killed_at_every_stage_and_restarted_the_run_is_exactly_once(tmp_path, monkeypatch, clean_rows):
    for fault in KILLS:  # each restart resumes the run the previous kill left
        monkeypatch.setenv("BATCHVLM_FAULTS", fault)
        result = run_embed(f"output.root={tmp_path}", "run_name=killed", "dataset.unit_records=3",
                           "runtime.num_workers=1")
        assert result.returncode != 0, f"{fault} did not fire"
        assert not (tmp_path / "killed" / "_SUCCESS").exists()
    monkeypatch.delenv("BATCHVLM_FAULTS")
    summary = summary_in_process(tmp_path, "killed", "dataset.unit_records=3", "runtime.num_workers=1")  # no kill
    assert summary is not None and summary["complete"]
    assert_exactly_once(tmp_path / "killed", clean_rows)


def test_a_run_directory_with_another_fingerprint_is_refused(demo_run):
    written = {path: path.stat().st_mtime_ns for path in demo_run.rglob("*")}
    # the job's own steps in this process: a ConfigError is the job's exit 2 (test_refusals_of_the_job.py proves the exit once)
    error = refused_in_process(demo_run.parent, "output.embed_dtype=float32", run_name=demo_run.name)
    assert {path: path.stat().st_mtime_ns for path in demo_run.rglob("*")} == written  # the run is left as it was
    assert "another fingerprint" in error and "embed_dtype: 'bfloat16' -> 'float32'" in error
    assert "run_name=" in error  # says how to start a new run


def test_a_rank_reports_its_count_and_reads_the_others_at_most_once_an_interval_or_a_commit(tmp_path):
    from batchvlm.bench.metadata import MetadataOps
    from batchvlm.executor.distributed import Coordinator, Ranks
    from batchvlm.rundir.durable import replace_json
    from batchvlm.rundir.layout import RunLayout
    from batchvlm.rundir.rank_reports import RankUnits

    layout = RunLayout(tmp_path)
    units = RankUnits()
    coordinator = Coordinator(layout, Ranks(0, 1, 0, None), report_s=3600, units=units)
    replace_json(layout.rank_file(coordinator.attempt, 1, "progress"), {"rank": 1, "records": 5})
    with MetadataOps(tmp_path) as ops:
        coordinator.report(10)
        assert coordinator.records_done(10) == 15
        first = sum(ops.counts.values())
        for seen in range(11, 100):  # a batch at a time, as the job shows progress
            coordinator.report(seen)
            assert coordinator.records_done(seen) == seen + 5
    assert sum(ops.counts.values()) == first  # nothing more written or read within the interval
    units.claimed = units.committed = 1  # a unit committed: reported at once
    coordinator.report(100)
    report = json.loads(layout.rank_file(coordinator.attempt, 0, "progress").read_text())
    assert report["records"] == 100 and report["units"]["committed"] == 1 and not report["finished"]
    coordinator.report(101)
    assert json.loads(layout.rank_file(coordinator.attempt, 0, "progress").read_text())["records"] == 100
    coordinator.report(102, finished=True)
    report = json.loads(layout.rank_file(coordinator.attempt, 0, "progress").read_text())
    assert report["records"] == 102 and report["finished"]
