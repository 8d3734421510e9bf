"""The tower bench's report: images/s and achieved TFLOP/s."""

from __future__ import annotations

import pytest

from batchvlm.bench import tower as tower_bench
from batchvlm.bench.tasks import BenchConfig
from batchvlm.bench.tower import bench_tower, format_tower
from batchvlm.families import ModelConfig

# a tiny tower in bf16 on two real photos, and a released one shrunk
pytestmark = pytest.mark.slow


def test_the_tower_bench_reports_images_per_second_and_achieved_tflops(monkeypatch):
    result = bench_tower(BenchConfig(task="tower", tower="tiny", records=2, device="cpu", repeats=1))
    assert (result["dtype"], result["records"], result["batches"]) == ("bfloat16", 2, 1)
    assert result["images_per_s"] > 0 and result["tflops"] > 0 and result["mfu"] == result["tflops"] / 989.0
    assert "TFLOP/s achieved" in format_tower(result) and result["attention"] == "sdpa"
    monkeypatch.setitem(tower_bench.RELEASED, "siglip2", dict(tower_bench.RELEASED["siglip2"], hidden_size=32,
                                                                 intermediate_size=64, num_hidden_layers=1,
                                                                 num_attention_heads=2))
    result = bench_tower(BenchConfig(task="tower", tower="released", model=ModelConfig(family="siglip2"), records=2,
                                     device="cpu", repeats=1))
    assert result["family"] == "siglip2" and result["tflops"] > 0
