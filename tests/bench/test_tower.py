"""The tower bench: the FLOPs it counts are torch's count of the tower's forward with every image's attention in it,
it reports images/s and achieved TFLOP/s, and it builds each family's tower at its released size."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from photos import photo_of_size, preprocessed

from batchvlm.bench.tower import model_flops, released_encoder
from batchvlm.families import ModelConfig
from batchvlm.families import load_family
from batchvlm.records import PixelBatch


def test_the_counted_flops_are_torchs_count_of_the_tower_with_each_images_attention(family):
    encoder = family.load_encoder(torch.device("cpu"), torch.float32)
    rows, grids = preprocessed(family, [photo_of_size(56, 84), photo_of_size(112, 112), photo_of_size(28, 28)])
    batch = PixelBatch(torch.cat(rows), torch.tensor(grids))
    with FlopCounterMode(display=False) as under_sdpa:
        encoder(batch.pixel_values, batch.grid_thw)
    counted = model_flops(encoder, [batch])
    alone = sum(model_flops(encoder, [PixelBatch(image_rows, torch.tensor([grid]))])
                for image_rows, grid in zip(rows, grids))
    # torch does not count its CPU flash attention: eager's matmuls are each image's attention, nothing across images
    assert counted > under_sdpa.get_total_flops() > 0 and counted == alone
    assert encoder.attention != "eager"  # put back as it was


@pytest.mark.parametrize("name,parameters", [("kimi_k25", 400e6), ("qwen2_vl", 675e6), ("siglip2", 400e6)])
def test_the_released_towers_have_their_published_sizes(name, parameters):
    family = load_family(ModelConfig(family=name))
    encoder = released_encoder(family, torch.device("meta"), torch.bfloat16, "sdpa")
    count = sum(p.numel() for p in encoder.tower.parameters())
    assert 0.95 * parameters < count < 1.1 * parameters, count
