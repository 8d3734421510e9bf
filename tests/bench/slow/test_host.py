"""The host ceiling (bench/host.py): the job with a zero-cost device stage writes every record, and its ratio to the
decode stage falls when the host pipeline costs more."""

from __future__ import annotations

import time

import pytest

from batchvlm.bench.e2e import bench_host, embeddings_of, format_host, host_ceiling, photo_jpegs, write_dataset
from batchvlm.bench.tasks import BenchConfig
from batchvlm.bench.tower import tower_model
from batchvlm.executor.batching import TokenBudgetBatcher


@pytest.mark.slow  # two jobs over six real photos
def test_a_per_record_cost_in_the_main_loop_lowers_the_host_ceiling(tmp_path, monkeypatch):
    path = write_dataset(tmp_path, photo_jpegs(6))
    model = tower_model(BenchConfig(task="e2e", tower="tiny", device="cpu"), embedding="auto")
    clean = host_ceiling(path, tmp_path / "clean", model, 3, 1, decode_rate=50.0)
    embeds = embeddings_of(tmp_path / "clean" / "e2e-host-1")
    assert len(embeds) == 6 and all(values.size and not values.any() for values in embeds.values())
    add = TokenBudgetBatcher.add
    cost = 1.0  # seconds a record in the main loop, several times what the clean job spends on one
    monkeypatch.setattr(TokenBudgetBatcher, "add", lambda self, record: time.sleep(cost) or add(self, record))
    slowed = host_ceiling(path, tmp_path / "slowed", model, 3, 1, decode_rate=50.0)
    assert slowed["ratio"] < clean["ratio"] / 2 and slowed["ratio"] == slowed["job_images_per_s"] / 50.0


@pytest.mark.slow  # three jobs over four real photos
def test_the_host_task_reports_the_best_of_its_runs_against_the_decode_stage():
    result = bench_host(BenchConfig(task="host", records=4, job_workers=1, repeats=2, device="cpu"))
    assert len(result["all"]) == 2 and result["job_images_per_s"] == max(result["all"])
    assert result["ratio"] == result["job_images_per_s"] / result["decode_images_per_s"]
    assert "host ceiling: 4 real photos, 1 workers" in format_host(result)
