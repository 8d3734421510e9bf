"""The tower bench: the FLOPs it counts are those torch counts, and it reports images/s and achieved TFLOP/s."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from photos import photo_of_size, preprocessed

from batchvlm.bench.tasks import BenchConfig
from batchvlm.bench.tower import bench_tower, format_tower, vit_flops
from batchvlm.families import ModelConfig
from batchvlm.families import load_family


def test_the_counted_flops_are_those_torch_counts_for_the_tower_under_eager_attention():
    """Under eager attention every matmul of the tower is an op torch's FlopCounterMode counts (its CPU flash
    attention it does not), so the formula is checked whole."""
    family = load_family(ModelConfig(attn_implementation="eager", embedding="tower"))
    encoder = family.load_encoder(torch.device("cpu"), torch.float32)
    rows, grids = preprocessed(family, [photo_of_size(56, 84), photo_of_size(112, 112), photo_of_size(28, 28)])
    with FlopCounterMode(display=False) as counter:
        encoder(torch.cat(rows), torch.tensor(grids))
    assert counter.get_total_flops() == vit_flops(encoder.tower.config, grids)


@pytest.mark.slow  # the tiny tower in bf16 on two real photos
def test_the_tower_bench_reports_images_per_second_and_achieved_tflops():
    result = bench_tower(BenchConfig(task="tower", tower="tiny", records=2, device="cpu", repeats=1))
    assert (result["dtype"], result["records"], result["batches"]) == ("bfloat16", 2, 1)
    assert result["images_per_s"] > 0 and result["tflops"] > 0 and result["mfu"] == result["tflops"] / 989.0
    assert "TFLOP/s achieved" in format_tower(result)
