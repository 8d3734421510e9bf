"""The host ceiling (bench/host.py): the job with a zero-cost device stage writes every record, and its ratio to the
decode stage falls when the host pipeline costs more."""

from __future__ import annotations

import time

import pytest

from batchvlm.bench.e2e import embeddings_of, host_ceiling, photo_jpegs, write_dataset
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
    monkeypatch.setattr(TokenBudgetBatcher, "add", lambda self, record: time.sleep(0.3) or add(self, record))
    slowed = host_ceiling(path, tmp_path / "slowed", model, 3, 1, decode_rate=50.0)
    assert slowed["ratio"] < clean["ratio"] / 2 and slowed["ratio"] == slowed["job_images_per_s"] / 50.0
