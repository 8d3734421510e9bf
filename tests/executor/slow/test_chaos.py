"""Chaos: SIGKILLs and SIGTERMs at random moments, a second job on the same run directory, a disk that fills up;
then one clean run, and the run holds exactly its input, each record once, as an undisturbed run wrote it."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import start_embed, summary_in_process
from forked import ForkedProcess

from batchvlm.demo import demo_rows
from batchvlm.rundir.verify import verify_run

# many runs of the job
pytestmark = pytest.mark.slow

SETTINGS = ("dataset.unit_records=2", "runtime.num_workers=1", "runtime.lease_s=3", "runtime.poll_s=0.2")
OVERRIDES = ("run_name=chaos", *SETTINGS)


SLOW_COMMITS = "pause.commit.before_manifest=0.2"
"""Each commit held a moment, so that a signal finds the run part way through."""


def start(root: Path, faults: str = "") -> ForkedProcess:
    env = {**os.environ, "BATCHVLM_FAULTS": ",".join(filter(None, [SLOW_COMMITS, faults]))}
    return start_embed(f"output.root={root}", *OVERRIDES, env=env, stdout=subprocess.DEVNULL, start_new_session=True)


def committed(run_dir: Path) -> int:
    return len(list((run_dir / "manifest").glob("*.json"))) if (run_dir / "manifest").is_dir() else 0


def interrupt(job: ForkedProcess, run_dir: Path, how: signal.Signals, rng: random.Random) -> bool:
    """Let the job commit some units (or end), wait a random moment more, then signal it and wait for it; whether it
    was still at work when signalled."""
    before = committed(run_dir)
    deadline = time.monotonic() + 120
    while job.poll() is None and committed(run_dir) <= before and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(rng.uniform(0, 0.5))
    at_work = job.poll() is None
    if at_work:
        with contextlib.suppress(ProcessLookupError):  # it ended meanwhile (the zygote reaps it at once)
            os.killpg(job.pid, how)
    job.wait(timeout=120)
    return at_work


def rows(run_dir: Path, kind: str) -> dict[str, dict]:
    return {row["id"]: row for path in sorted((run_dir / kind).glob("*.parquet"))
            for row in pq.read_table(path).to_pylist()}


def test_after_kills_a_second_job_and_a_full_disk_the_run_holds_its_input_exactly_once(demo_run, tmp_path):
    rng = random.Random(19)
    run_dir = tmp_path / "chaos"
    interrupted = 0
    for event in ["kill", "term", "full disk", "kill", "term", "second job"]:
        if event in ("kill", "term"):
            how = signal.SIGKILL if event == "kill" else signal.SIGTERM
            interrupted += interrupt(start(tmp_path), run_dir, how, rng)
        elif event == "second job":
            first, second = start(tmp_path), start(tmp_path)
            interrupt(first, run_dir, signal.SIGKILL, rng)
            second.wait(timeout=600)
            assert second.returncode == 0, second.stderr.read()[-3000:]
        else:
            full = start(tmp_path, faults=f"disk_full.publish={rng.randint(2, 6)}")
            full.wait(timeout=600)
            assert full.returncode != 0 and "no space left on the device" in full.stderr.read()
    assert interrupted == 4  # every signal found a job at work: the run was disturbed for real
    summary = summary_in_process(tmp_path, "chaos", *SETTINGS)  # the clean run, in this process
    assert summary is not None and summary["complete"]
    assert verify_run(run_dir) == []
    data, quarantine = rows(run_dir, "data"), rows(run_dir, "quarantine")
    assert sorted([*data, *quarantine]) == sorted(row["id"] for row in demo_rows())
    assert data == rows(demo_run, "data")  # embeddings identical to an undisturbed run's
