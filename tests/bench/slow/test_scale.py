"""The scale bench: the plan's cost against the rows, the time to a first commit, peak memory at N and 10N records,
and no `datasets` cache growth; the job it times to its first commit is stopped with every process it started."""

from __future__ import annotations

import pytest

from batchvlm.bench.scale import bench_scale, format_scale
from batchvlm.bench.tasks import BenchConfig


@pytest.mark.slow
def test_the_scale_bench_reports_plan_cost_first_commit_and_memory_side_by_side(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHVLM_BENCH_DIR", str(tmp_path))
    result = bench_scale(BenchConfig(task="scale", rows=400, files=4, rss_records=8, first_unit_records=20))
    assert result["plans"]["all"]["records"] == 400 and result["plans"]["tenth"]["records"] == 40
    assert result["first_commit_s"] > 0 and result["rss_records"] == {"N": 8, "10N": 80}
    assert min(result["peak_rss_mb"].values()) > 0 and result["hf_cache_growth_bytes"] == 0
    report = format_scale(result)
    assert "plan time 1/10 rows vs all rows" in report and "10N/N = " in report
