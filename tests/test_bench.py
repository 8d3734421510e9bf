"""The preprocessing benchmark runs wherever the job runs (on CPU: torch vs the HF processor)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from batchvlm.bench.tasks import BenchConfig, bench_preprocess, format_preprocess
from batchvlm.config import ConfigError

CONF = Path(__file__).resolve().parents[1] / "conf"


def test_preprocess_bench_reports_throughput_and_ratios_side_by_side():
    result = bench_preprocess(BenchConfig(repeats=1))
    expected = {"torch", "hf"} | ({"triton"} if torch.cuda.is_available() else set())
    assert set(result["backends"]) == expected
    for row in result["backends"].values():
        assert row["images_per_s"] > 0 and row["bytes_per_s"] > 0
    assert "torch/hf" in result["ratios"]
    assert "speed-up: " in format_preprocess(result)


def test_the_bench_config_composes_and_refuses_bad_values():
    ConfigStore.instance().store(name="bench_schema", node=BenchConfig)
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        assert OmegaConf.to_object(compose(config_name="bench")).task == "preprocess"
        with pytest.raises(ConfigError, match="repeats"):
            OmegaConf.to_object(compose(config_name="bench", overrides=["repeats=0"]))


@pytest.mark.slow
def test_e2e_bench_puts_the_job_beside_its_tower_and_the_sink_beside_a_bare_write():
    from batchvlm.bench.e2e import bench_e2e, format_e2e

    result = bench_e2e(BenchConfig(task="e2e", tower="tiny", records=4, device="cpu"))
    assert set(result["stages"]) == {"decode", "plan+layout", "preprocess", "tower+checks", "assemble", "sink"}
    assert all(rate > 0 for rate in result["stages"].values())
    assert result["job_images_per_s"] > 0 and result["tower_images_per_s"] > 0
    assert result["batch_by_batch_images_per_s"] > 0 and result["device_decode_images_per_s"] > 0
    assert all(result["decode"][key] > 0 for key in ("safe_images_per_s", "batched_images_per_s", "header_images_per_s"))
    assert result["decode"]["max_levels"] == 0  # libjpeg-turbo both ways on the CPU
    assert "batch by batch" in format_e2e(result) and "batched torchvision on cpu" in format_e2e(result)
    assert "end-to-end" in format_e2e(result) and "bare pq.write_table" in format_e2e(result)
