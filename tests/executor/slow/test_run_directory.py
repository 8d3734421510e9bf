"""The job and its run directory: it never writes into, nor cleans up in, a folder of someone else's files; a second
job joins a live run as one more claimant and neither crashes, whatever commit is under way; a rank frozen through
the end of the run wakes and ends without error; a resume redoes a unit whose files are not whole."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
from conftest import refused_in_process, start_embed, summary_in_process
from forked import ForkedProcess

from batchvlm.demo import demo_rows
from batchvlm.rundir.verify import verify_run

# runs of the job
pytestmark = pytest.mark.slow

INPUT_IDS = sorted(row["id"] for row in demo_rows())


def ids_in(run_dir: Path) -> list[str]:
    import pyarrow.parquet as pq

    return sorted(row["id"] for kind in ("data", "quarantine") for path in (run_dir / kind).glob("*.parquet")
                  for row in pq.read_table(path, columns=["id"]).to_pylist())


def start(tmp_path: Path, name: str, *overrides: str, faults: str = "") -> ForkedProcess:
    env = {**os.environ, "BATCHVLM_FAULTS": faults} if faults else None
    return start_embed(f"output.root={tmp_path}", f"run_name={name}", *overrides, env=env)


def test_a_folder_of_someone_elses_files_is_refused_and_nothing_in_it_is_touched(tmp_path):
    project = tmp_path / "proj"
    (project / "data").mkdir(parents=True)
    (project / "ids").mkdir()
    files = {project / "data" / "train.parquet": b"PAR1 the user's data PAR1", project / "README.md": b"# mine",
             project / "ids" / "ids.csv": b"id\n1\n"}
    for path, data in files.items():
        path.write_bytes(data)
    # the job's own steps in this process: a ConfigError is the job's exit 2 (test_refusals_of_the_job.py proves the exit once)
    error = refused_in_process(tmp_path, run_name="proj")
    assert "not a batchvlm run directory" in error
    assert {path: path.read_bytes() for path in files} == files
    assert sorted(p.relative_to(project).as_posix() for p in project.rglob("*")) == [
        "README.md", "data", "data/train.parquet", "ids", "ids/ids.csv"]


def shards_without_manifest(run_dir: Path) -> bool:
    """A holder is between renaming a unit's shards and publishing its manifest."""
    manifests = {path.stem for path in (run_dir / "manifest").glob("*.json")} if (run_dir / "manifest").is_dir() else set()
    return any(path.name.split(".")[0] not in manifests for path in (run_dir / "data").glob("*.parquet"))


def test_a_second_job_started_during_a_commit_joins_and_both_end_cleanly(tmp_path):
    # three units, each commit of the first job held 2 s: the second job starts during the first one
    first = start(tmp_path, "shared", "dataset.unit_records=7", "runtime.num_workers=0",
                  faults="pause.commit.before_manifest=2")
    deadline = time.monotonic() + 300
    while not (tmp_path / "shared" / "data").is_dir() or not shards_without_manifest(tmp_path / "shared"):
        assert first.poll() is None and time.monotonic() < deadline, first.stderr.read()[-3000:]
        time.sleep(0.1)
    # the second job in this process (the first's paused commit is what it meets; two processes either way)
    second = summary_in_process(tmp_path, "shared", "dataset.unit_records=7", "runtime.num_workers=0")
    out, err = first.communicate(timeout=600)
    assert first.returncode == 0, err[-3000:]
    assert second is not None  # ended without error, with rank 0's summary
    assert verify_run(tmp_path / "shared") == []
    assert ids_in(tmp_path / "shared") == INPUT_IDS


def test_a_rank_frozen_through_the_end_of_the_run_wakes_and_ends_without_error(tmp_path):
    overrides = ("dataset.unit_records=4", "runtime.num_workers=0", "runtime.lease_s=2", "runtime.poll_s=0.2")
    frozen = start(tmp_path, "frozen", *overrides, faults="pause.commit.before_manifest=0.5")
    while not (tmp_path / "frozen" / "manifest").is_dir() or not any((tmp_path / "frozen" / "manifest").glob("*.json")):
        assert frozen.poll() is None, frozen.stderr.read()[-3000:]
        time.sleep(0.05)
    os.kill(frozen.pid, signal.SIGSTOP)  # its heartbeat stops with it: its units are taken over after the lease
    try:
        finisher = summary_in_process(tmp_path, "frozen", *overrides)  # in this process
        assert finisher["complete"], finisher
        assert (tmp_path / "frozen" / "_SUCCESS").exists()
    finally:
        os.kill(frozen.pid, signal.SIGCONT)
    out, err = frozen.communicate(timeout=300)
    assert frozen.returncode == 0, err[-3000:]
    assert verify_run(tmp_path / "frozen") == [] and ids_in(tmp_path / "frozen") == INPUT_IDS


def test_a_resume_redoes_a_unit_whose_shard_was_truncated(demo_run, tmp_path, caplog):
    copy = tmp_path / "copy"
    shutil.copytree(demo_run, copy)
    (copy / "_SUCCESS").unlink()  # as if it crashed after this unit committed
    manifest = next(m for m in sorted((copy / "manifest").glob("*.json")) if "data" in json.loads(m.read_text())["files"])
    shard = copy / json.loads(manifest.read_text())["files"]["data"][0]["path"]
    shard.write_bytes(shard.read_bytes()[:-10])
    with caplog.at_level(logging.WARNING, logger="batchvlm"):
        summary = summary_in_process(tmp_path, "copy")  # in this process: no signal, no second process
    assert summary["complete"]
    assert f"unit {manifest.stem} is not whole" in caplog.text
    assert verify_run(copy) == [] and ids_in(copy) == INPUT_IDS
