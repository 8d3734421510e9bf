"""The loader bench beside a pyarrow scan, and the bench run from an installed wheel in an empty folder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import REPO, committed_shards

from batchvlm.bench.tasks import BenchConfig, bench_loader, format_loader

# the bench as a process, and a wheel built and installed
pytestmark = pytest.mark.slow


def test_the_loader_bench_reports_the_ratio_to_a_pyarrow_scan_and_packing_efficiency(qwen_run):
    result = bench_loader(BenchConfig(task="loader", run_dir=str(qwen_run), repeats=1, max_tokens=1024))
    assert result["tokens"] == sum(len(ids) for shard in committed_token_counts(qwen_run) for ids in shard)
    assert result["ratio"] > 0 and 0 < result["packing_efficiency"] <= 1
    report = format_loader(result)
    assert "loader / pyarrow scan: " in report and "packing efficiency: " in report


def committed_token_counts(run_dir: Path) -> list[list[int]]:
    return [pq.read_table(path, columns=["input_ids"]).column("input_ids").to_pylist() for path in committed_shards(run_dir)]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    """batchvlm as a wheel installs it (no source checkout on the path): the environment that imports it."""
    root = tmp_path_factory.mktemp("installed")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(root / "wheel"), str(REPO)], check=True, capture_output=True, timeout=300)
    wheel = next((root / "wheel").glob("batchvlm-*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(root / "site"),
                    str(wheel)], check=True, capture_output=True, timeout=300)
    return {**os.environ, "PYTHONPATH": str(root / "site")}


def test_the_bench_runs_from_an_installed_wheel_in_an_empty_folder(installed, tmp_path):
    where = subprocess.run([sys.executable, "-c", "import batchvlm.jobs.embed, batchvlm; print(batchvlm.__file__)"],
                           cwd=tmp_path, env=installed, capture_output=True, text=True, timeout=120)
    assert where.stdout.startswith(installed["PYTHONPATH"]), where.stderr[-2000:]
    # task=loader embeds the demo with the installed job first: both find what they need in the package alone
    result = subprocess.run([sys.executable, "-m", "batchvlm.jobs.bench", "task=loader", "copies=1", "repeats=1"],
                            cwd=tmp_path, env=installed, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "loader / pyarrow scan: " in result.stdout
