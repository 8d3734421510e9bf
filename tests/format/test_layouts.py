"""Patch layouts as data: each puts a pixel of a known image at the row and place its family's tower reads."""

from __future__ import annotations

import torch

from batchvlm.format.layouts import MERGE_WINDOW, RASTER_CHW, RASTER_HWC, PatchLayout


def image(height: int, width: int) -> torch.Tensor:
    """A CHW image whose value says where it is: channel * 10000 + row * 100 + column."""
    c, y, x = torch.meshgrid(torch.arange(3), torch.arange(height), torch.arange(width), indexing="ij")
    return (c * 10000 + y * 100 + x).float()


def test_raster_chw_rows_are_patches_in_raster_order():
    rows = PatchLayout(RASTER_CHW, patch_size=2).patchify(image(4, 6))
    assert rows.shape == (6, 3, 2, 2)
    assert rows[4, 1, 0, 1] == 10000 + 2 * 100 + 3  # patch (1, 1), channel 1, its pixel (0, 1)


def test_raster_hwc_rows_are_channels_last():
    rows = PatchLayout(RASTER_HWC, patch_size=2).patchify(image(2, 4))
    assert rows.shape == (2, 12)
    assert rows[1, :3].tolist() == [2.0, 10002.0, 20002.0]  # patch 1's first pixel, its three channels


def test_merge_window_rows_group_each_window_and_repeat_a_still_image_over_frames():
    layout = PatchLayout(MERGE_WINDOW, patch_size=1, merge_size=2, temporal_patch_size=2)
    rows = layout.patchify(image(2, 4))
    assert rows.shape == (8, 6) and layout.row_shape == (6,)
    # the first window's four patches come first: (0, 0), (0, 1), (1, 0), (1, 1); then the next window at column 2
    assert [int(row[0]) for row in rows[:5]] == [0, 1, 100, 101, 2]
    assert torch.equal(rows[:, 0], rows[:, 1])  # frame 0 and frame 1 of channel 0: the same image
