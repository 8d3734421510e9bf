"""jobs/gpu_check.sh --dry-run: every step rehearsed, and the missing wheel named."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import REPO
from test_gpu_check import STEPS

# each step starts a Python that imports torch: about a minute
pytestmark = pytest.mark.slow


def pinned_wheels() -> list[str]:
    """The file names of the wheels jobs/gpu_wheels.txt pins, as pip saves them."""
    pins = [line.split("#")[0].strip() for line in (REPO / "jobs" / "gpu_wheels.txt").read_text().splitlines()]
    return [f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
            for name, version in (pin.split("==") for pin in pins if pin)]


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
