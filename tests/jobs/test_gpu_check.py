"""jobs/gpu_check.sh rehearsed on the CPU (--dry-run): every step up to the device, each reported, the script going on
past a failing one."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import REPO

STEPS = ["versions", "e2e base tower, 8 workers", "e2e base tower, 14 workers", "e2e tiny tower, 8 workers",
         "tower MFU per family", "preprocessing per family", "nvJPEG vs libjpeg-turbo", "CUDA tests"]
SCRIPT = REPO / "jobs" / "gpu_check.sh"


def pinned_wheels() -> list[str]:
    """The file names of the wheels jobs/gpu_wheels.txt pins, as pip saves them."""
    pins = [line.split("#")[0].strip() for line in (REPO / "jobs" / "gpu_wheels.txt").read_text().splitlines()]
    return [f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
            for name, version in (pin.split("==") for pin in pins if pin)]


@pytest.mark.slow  # each step starts a Python that imports torch: about a minute
def test_a_dry_run_rehearses_every_step_and_names_the_wheel_that_is_missing(tmp_path):
    wheels = pinned_wheels()
    assert "transformers-5.24.0-py3-none-any.whl" in wheels and "hydra_core-1.3.8-py3-none-any.whl" in wheels
    for name in wheels:
        if not name.startswith("multiprocess"):
            (tmp_path / name).touch()
    env = {**os.environ, "PYTHON": sys.executable, "BATCHVLM_WHEELS": str(tmp_path)}
    result = subprocess.run(["bash", "jobs/gpu_check.sh", "--dry-run"], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    summary = result.stdout.split("== summary (dry")[1].splitlines()[1:]
    assert [line.split(":")[0] for line in summary] == ["wheels", *STEPS]
    assert summary[0].startswith("wheels: FAILED (exit 1)")
    assert all(": ok," in line for line in summary[1:]), summary
    assert f"missing from {tmp_path}: multiprocess==0.70.19; fetch them with: bash jobs/gpu_check.sh --fetch-wheels" \
        in result.stdout
    assert "would run: nvidia-smi" in result.stdout and "dry run: task=tower" in result.stdout
    assert result.stdout.count("dry run: task=e2e") == 3 and result.stdout.count("dry run: task=preprocess") == 3
    checked = {(line.split("task=")[1].split()[0], line.split("model=")[1].split(",")[0])
               for line in result.stdout.splitlines() if line.startswith("dry run:")}
    per_family = {(task, family) for task in ("tower", "preprocess") for family in ("kimi_k25", "qwen2_vl", "siglip2")}
    assert checked == per_family | {("e2e", "kimi_k25"), ("jpeg", "kimi_k25")}  # per family: one sweep, 3 configs


def step_limits() -> dict[str, int]:
    """Each step's timeout, as the script declares it."""
    steps = SCRIPT.read_text().split("STEPS=(")[1].split("\n)")[0]
    return {name: int(limit) for name, limit, _ in (line.strip().strip('"').split("|", 2)
                                                      for line in steps.strip().splitlines())}


def test_the_steps_timeouts_with_their_kill_after_fit_a_rerun_under_the_device_tools_cap():
    limits = step_limits()
    kill_after = int(SCRIPT.read_text().split("KILL_AFTER=")[1].split()[0])
    assert list(limits) == ["wheels", *STEPS]
    assert sum(limits.values()) + kill_after * len(limits) < 6 * 60


def test_an_unknown_option_is_refused():
    result = subprocess.run(["bash", "jobs/gpu_check.sh", "--fast"], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 2 and "usage: bash jobs/gpu_check.sh" in result.stderr
