"""The estimate sizes the job from a sample of its input, without a tower: within 10 % of what the job then writes."""

from __future__ import annotations

import io
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import REPO, run_embed
from PIL import Image

from batchvlm.sizing.estimate import EstimateConfig
from batchvlm.sources.config import dataset_config
from batchvlm.sizing.estimate import estimate, format_estimate
from batchvlm.rundir.layout import DATA, QUARANTINE, RunLayout
from batchvlm.rundir.manifest import all_manifests

# the job (and the estimate) on real data
pytestmark = pytest.mark.slow


def written_bytes(run_dir) -> int:
    """What the job wrote that the estimate sizes: its data and quarantine shards."""
    return sum(listing.bytes for manifest in all_manifests(RunLayout(run_dir)) for kind in (DATA, QUARANTINE)
               for listing in manifest.shards(kind))


def test_the_estimate_of_the_demo_is_within_ten_percent_of_the_bytes_the_job_writes(demo_run):
    result = estimate(EstimateConfig(dataset=dataset_config("demo", unit_records=6)))
    assert result.records == 21 and result.sampled == 21 and result.units == 4
    assert abs(result.total_bytes / written_bytes(demo_run) - 1) <= 0.10


def mixed_sizes(path, count: int) -> None:
    rng = np.random.default_rng(0)
    images = []
    for index in range(count):
        height, width = int(rng.integers(20, 700)), int(rng.integers(20, 700))
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (height, width, 3), np.uint8)).save(buffer, format="JPEG", quality=70)
        images.append([buffer.getvalue()])
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(count)], "images": images,
                             "text": ["<image> noise"] * count}), path, row_group_size=8)


def test_the_estimate_of_mixed_image_sizes_from_a_sample_is_within_ten_percent(tmp_path):
    mixed_sizes(tmp_path / "mixed.parquet", 48)
    overrides = ["dataset=parquet", f"dataset.path={tmp_path / 'mixed.parquet'}", "dataset.unit_records=8"]
    result = run_embed(f"output.root={tmp_path}", "run_name=mixed", *overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    sampled = subprocess.run([sys.executable, str(REPO / "jobs" / "estimate.py"), *overrides, "records=24",
                              "images_per_s=200", "devices=8"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert sampled.returncode == 0, sampled.stderr[-3000:]
    report = sampled.stdout
    assert "sample: 24 records" in report and "records: 48 in 6 units" in report and " h, writing " in report
    estimated = estimate(EstimateConfig(dataset=dataset_config("parquet", path=str(tmp_path / "mixed.parquet"),
                                                              unit_records=8), records=24))
    assert abs(estimated.total_bytes / written_bytes(tmp_path / "mixed") - 1) <= 0.10
    assert "tokens per image: p50 " in format_estimate(estimated)
