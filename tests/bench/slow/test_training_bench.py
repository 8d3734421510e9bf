"""task=train: the bench times stored features and pixels over the same batches."""

from __future__ import annotations

import pytest

from batchvlm.bench.tasks import BenchConfig
from batchvlm.bench.training import bench_train, format_train
from batchvlm.families import ModelConfig

# a run of the job, then training steps
pytestmark = pytest.mark.slow


def test_the_train_bench_times_stored_features_and_pixels_over_the_same_batches(qwen_run):
    config = BenchConfig(task="train", run_dir=str(qwen_run), tower="tiny", model=ModelConfig(family="qwen2_vl"),
                         steps=2, repeats=1, max_tokens=1024)
    result = bench_train(config)
    assert result["steps"] == 2 and result["images"] > 0 and result["model"] == "Qwen2VLForConditionalGeneration"
    assert set(result["paths"]) == {"stored", "pixels", "pixels, preprocessed once"}
    assert all(row["steps_per_s"] > 0 for row in result["paths"].values())
    assert "stored / pixels: " in format_train(result)
