"""The benchmark tasks run wherever the job runs (on the CPU: torch vs the HF processor), from an installed package
in any folder; the loader bench puts the loader beside a bare pyarrow scan of the same shards."""

from __future__ import annotations

import pytest
import torch
from conftest import REPO
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from batchvlm.bench.tasks import BenchConfig, bench_preprocess, format_preprocess
from batchvlm.config import ConfigError

CONF = REPO / "conf"


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


def test_the_bench_config_takes_task_loader_and_refuses_an_unknown_task():
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    ConfigStore.instance().store(name="bench_schema", node=BenchConfig)
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        assert OmegaConf.to_object(compose(config_name="bench", overrides=["task=loader"])).task == "loader"
        with pytest.raises(Exception) as caught:  # the schema's Enum refuses it as the config composes
            compose(config_name="bench", overrides=["task=fly"])
    assert "task=fly" in str(caught.value) and "preprocess, scale, loader" in str(caught.value.__cause__)
