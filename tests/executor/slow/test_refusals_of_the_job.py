"""The job's process refusing and stopping: its summary, its one line, nothing left behind, its workers gone on
SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import run_embed, start_embed, summary_in_process

# runs of the job as a process
pytestmark = pytest.mark.slow


def one_line_error(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    return lines[0]


def test_a_run_on_a_tiny_checkpoint_says_so_in_its_summary_and_fingerprint(tmp_path):
    from batchvlm.executor.job import summarize

    summary = summary_in_process(tmp_path, "tiny", "dataset.limit=2")
    assert summary is not None and summary["complete"]
    assert "tiny demo checkpoint" in summarize(summary)  # what the job prints as it ends
    assert '"checkpoint": "tiny"' in (tmp_path / "tiny" / "fingerprint.json").read_text()


def test_a_checkpoint_without_safetensors_is_refused_in_one_line_leaving_nothing(tmp_path):
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text('{"model_type": "kimi_k25"}')
    (checkpoint / "pytorch_model.bin").write_bytes(b"\x80\x04 a pickle, never unpickled")
    result = run_embed(f"output.root={tmp_path / 'out'}", "model=kimi_k25", f"model.path={checkpoint}")
    assert result.returncode == 2 and "safetensors" in one_line_error(result)
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []


def test_a_full_disk_ends_the_job_in_one_line_naming_the_path(tmp_path):
    env = {**os.environ, "BATCHVLM_FAULTS": "disk_full.publish=8"}  # past the run's own files, at a unit's commit
    result = run_embed(f"output.root={tmp_path}", "run_name=full", env=env)
    assert result.returncode != 0
    line = one_line_error(result)
    assert "no space left on the device writing " + str(tmp_path / "full") in line


def many_records(path: Path, count: int) -> Path:
    import io

    import numpy as np
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.full((64, 64, 3), 90, np.uint8)).save(buffer, format="PNG")
    pq.write_table(pa.table({"id": [f"r{i:05d}" for i in range(count)], "images": [[buffer.getvalue()]] * count,
                             "text": ["<image> a gray square"] * count}), path, row_group_size=20)
    return path


def processes_of(session: int) -> list[int]:
    """The live (not zombie) processes of a session, from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == session and fields[0] != "Z":
                found.append(int(entry.name))
    return found


def test_sigterm_stops_the_job_and_its_workers(tmp_path):
    data = many_records(tmp_path / "many.parquet", 2000)
    job = start_embed("dataset=parquet", f"dataset.path={data}", f"output.root={tmp_path}", "run_name=term",
                      "dataset.unit_records=20", "runtime.num_workers=2", start_new_session=True)
    manifests = tmp_path / "term" / "manifest"
    deadline = time.monotonic() + 300
    while not (manifests.is_dir() and any(manifests.glob("*.json"))) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(processes_of(job.pid)) >= 3  # the job and its two workers, at work
    job.send_signal(signal.SIGTERM)
    job.wait(timeout=60)
    settled = time.monotonic() + 1.0  # its workers end with it: none left a second after it, at the latest
    while processes_of(job.pid) and time.monotonic() < settled:
        time.sleep(0.05)
    assert processes_of(job.pid) == []
