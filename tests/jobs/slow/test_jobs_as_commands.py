"""The jobs as commands a user runs: installed console scripts, refused configs leaving nothing, Hydra's multirun
resuming."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, embed_command, run_embed, run_job_command

# the jobs as processes
pytestmark = pytest.mark.slow


def run_script(name: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """A console script of the environment the tests run in, as a user types it."""
    return subprocess.run([str(Path(sys.executable).parent / name), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


def test_an_installed_job_composes_its_packaged_configs_from_any_folder(tmp_path):
    result = run_script("batchvlm-embed", "--cfg", "job", "model=siglip2_tiny", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "kind: demo" in result.stdout and "family: siglip2" in result.stdout
    assert list(tmp_path.iterdir()) == []  # --cfg runs nothing, writes nothing


@pytest.mark.parametrize("job", ["report", "verify", "status", "export"])
def test_a_job_without_run_dir_says_how_to_give_it(job, tmp_path):
    result = run_job_command(job, cwd=tmp_path, timeout=300)
    assert result.returncode == 2
    assert result.stderr.strip() == "error: run_dir is required: run_dir=outputs/<run>"


def test_a_refused_config_leaves_no_run_folder_behind(tmp_path):
    # a fresh interpreter (not forked, tests/forked.py): its stderr is the refusal's one line, with nothing a
    # dependency prints as it is imported
    result = subprocess.run(embed_command(f"output.root={tmp_path}", "model.dtype=int8"), cwd=REPO, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 2
    assert result.stderr.strip() == "error: model.dtype: Invalid value 'int8', expected one of [float32, bfloat16, float16]"
    assert list(tmp_path.iterdir()) == []  # Hydra made the run folder (and the log) before the check


def test_a_multirun_sweep_resumes_in_the_run_directories_of_single_runs(demo_run, tmp_path):
    before = {p: p.stat().st_mtime_ns for p in demo_run.rglob("*") if p.is_file() and p.suffix != ".log"}
    result = run_embed("-m", f"output.root={demo_run.parent}", f"run_name={demo_run.name},sweep_b", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"{demo_run} is already complete: nothing to do" in result.stdout
    assert {p: p.stat().st_mtime_ns for p in before} == before  # the finished run was not recomputed
    assert (demo_run.parent / "sweep_b" / "_SUCCESS").exists()
    assert not (tmp_path / "multirun").exists()  # Hydra's default sweep folder under the working directory
