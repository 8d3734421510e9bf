"""A tower's inputs built once per image grid (towers.grids) are transformers' own for the whole batch, bit for bit."""

from __future__ import annotations

import pytest
import torch
from transformers.models.kimi_k25.modeling_kimi_k25 import get_vision_frame_index, get_vision_temporal_merge_index
from transformers.vision_utils import (get_vision_cu_seqlens, get_vision_interpolation_indices_and_weights,
                                       get_vision_position_ids)

from batchvlm.towers.grids import PerGrid, interpolation_taps

GRIDS = [(1, 78, 138), (1, 2, 2), (1, 54, 72), (2, 8, 6), (1, 78, 138), (1, 130, 130), (1, 2, 512), (1, 34, 46)]


@pytest.mark.parametrize("mode,align_corners,side,merge", [("bicubic", False, 64, 1), ("bicubic", False, 16, 1),
                                                            ("bilinear", True, 48, 2), ("bilinear", False, 32, 2)])
def test_taps_from_a_row_and_a_column_equal_transformers_patch_by_patch(mode, align_corners, side, merge):
    grids = [grid for grid in GRIDS if grid[1] % merge == 0 and grid[2] % merge == 0]
    expected = get_vision_interpolation_indices_and_weights(torch.tensor(grids), side, mode=mode,
                                                            align_corners=align_corners, spatial_merge_size=merge)
    ours = [interpolation_taps(grid, side, mode, align_corners, merge) for grid in grids]
    assert torch.equal(torch.cat([taps for taps, _ in ours]), expected[0])
    assert torch.equal(torch.cat([weights for _, weights in ours]), expected[1])


def test_kimi_inputs_joined_per_image_equal_transformers_on_the_whole_batch(kimi_family):
    encoder = kimi_family.load_encoder(torch.device("cpu"), torch.float32)
    grid_thw = torch.tensor(GRIDS)
    table = encoder.tower.patch_embed.pos_emb
    taps, weights = get_vision_interpolation_indices_and_weights(grid_thw, table.num_grid_per_side,
                                                                 mode=table.interpolation_mode,
                                                                 align_corners=table.interpolation_align_corners)
    destination, frame_weight, merged = get_vision_temporal_merge_index(grid_thw, *encoder.tower.merge_kernel_size)
    for _ in range(2):  # computed, then every grid kept
        _, kwargs = encoder.inputs(torch.zeros(int(grid_thw.prod(-1).sum()), 3, 14, 14), grid_thw)
        assert torch.equal(kwargs["position_ids"], get_vision_position_ids(grid_thw, spatial_merge_size=1))
        assert torch.equal(kwargs["interp_indices"], taps) and torch.equal(kwargs["interp_weights"], weights)
        assert torch.equal(kwargs["frame_index"], get_vision_frame_index(grid_thw))
        ours = kwargs["temporal_merge_index"]
        assert torch.equal(ours[0], destination) and torch.equal(ours[1], frame_weight) and ours[2] == merged
        assert torch.equal(kwargs["cu_seqlens"], get_vision_cu_seqlens(grid_thw, merge_temporal=True))
    assert len(encoder.per_grid.kept) == len(set(GRIDS))


def test_the_least_recently_used_grids_leave_first_past_the_patch_limit():
    computed = []
    per_grid = PerGrid(lambda grid: computed.append(grid) or {"grid": grid}, max_patches=100)
    per_grid(torch.tensor([[1, 5, 10], [1, 4, 10], [1, 5, 10]]))  # 90 patches kept
    per_grid(torch.tensor([[1, 2, 10]]))  # 110: the least recently used (1, 4, 10) leaves
    per_grid(torch.tensor([[1, 5, 10], [1, 4, 10]]))
    assert computed == [(1, 5, 10), (1, 4, 10), (1, 2, 10), (1, 4, 10)]
