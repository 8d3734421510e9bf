"""batchvlm-status following a running job, a killed rank and the finished run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import run_job_command, start_embed, summary_in_process

from batchvlm.review.status import format_status, run_status
from batchvlm.rundir.verify import run_counts

# a real job in a subprocess
pytestmark = pytest.mark.slow


AUDIT = """
import sys
from pathlib import Path
run = sys.argv[1]
touched = []
def hook(event, args):
    if event in ("open", "os.listdir", "os.scandir") and args and str(args[0]).startswith(run):
        touched.append(str(args[0]))
sys.addaudithook(hook)
from batchvlm.review.status import run_status
status = run_status(Path(run))
print(status.units_committed)
print("\\n".join(touched))
"""


def status_of(run_dir: Path, *more: str) -> subprocess.CompletedProcess:
    return run_job_command("status", f"run_dir={run_dir}", *more, timeout=120)


def wait_for(condition, timeout: float = 240.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := condition():
            return found
        time.sleep(0.5)
    raise AssertionError("the job never got there")


def test_status_follows_a_running_job_a_killed_rank_and_the_finished_run(tmp_path):
    settings = ("dataset.unit_records=2", "runtime.num_workers=1", "runtime.progress_interval_s=0.5")
    run_dir = tmp_path / "slow"
    env = {**os.environ, "BATCHVLM_FAULTS": "pause.commit.before_manifest=1.5"}  # a job slow enough to watch
    job = start_embed(f"output.root={tmp_path}", "run_name=slow", *settings, env=env, stdout=subprocess.DEVNULL,
                      stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        running = wait_for(lambda: (s := run_status(run_dir) if (run_dir / "units.json").exists() else None)
                           and s.units_committed >= 2 and s)
        assert running.state == "running" and running.units_total == 11 and running.records_total == 21
        assert 2 <= running.units_committed < 11 and running.ranks[0].units_held >= 1
        assert running.ranks[0].heartbeat_age_s < 30 and not running.stale_ranks
        assert 1 <= running.blocks_claimed <= running.blocks_total
        shown = format_status(running)  # what the command prints (its process: the JSON one below)
        assert "running, 1 rank(s) live" in shown and " / 11 committed" in shown
        os.killpg(job.pid, signal.SIGKILL)
        job.wait(timeout=60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()

    killed = run_status(run_dir)
    assert killed.state == "stopped" and killed.ranks[0].stale and killed.ranks[0].why_stale == "its process is gone"
    assert "STALE: its process is gone" in format_status(killed)

    audited = subprocess.run([sys.executable, "-c", AUDIT, str(run_dir)], capture_output=True, text=True,
                             timeout=120, check=True)
    committed, *touched = audited.stdout.split("\n")
    assert int(committed) >= 2
    # no manifest nor shard is read, nor their folders listed
    assert not [path for path in touched if path.startswith((f"{run_dir}/manifest", f"{run_dir}/data"))]
    # the format marker, plan, totals, config, the claim frontier, the launch's folders, a report, a heartbeat
    assert len([path for path in touched if path]) <= 10, "\n".join(touched)

    summary = summary_in_process(tmp_path, "slow", *settings)  # the rerun, in this process
    assert summary is not None and summary["complete"]
    done = format_status(run_status(run_dir))
    counts = run_counts(run_dir)
    assert f"{run_dir}: complete" in done
    assert "11 / 11 committed" in done and f"{counts.records_in:,} of 21 in committed units" in done
    shown = status_of(run_dir, "format=json")
    assert shown.returncode == 0, shown.stderr[-3000:]
    as_json = json.loads(shown.stdout)
    assert (as_json["units_committed"], as_json["written"], as_json["bytes_written"]) == (
        counts.units, counts.written, counts.bytes)
