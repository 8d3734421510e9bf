"""task=train: training steps on stored features beside the same steps on pixels, over the same packed batches."""

from __future__ import annotations

import pytest

from batchvlm.bench.tasks import BenchConfig
from batchvlm.bench.training import bench_train
from batchvlm.config import ConfigError


def test_the_train_bench_refuses_a_released_size_tower():
    with pytest.raises(ConfigError, match="tower=released"):
        bench_train(BenchConfig(task="train", tower="released"))
