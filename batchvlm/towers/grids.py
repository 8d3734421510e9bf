"""What a tower computes from its images' grids (positions, interpolation taps of its position table, merge and window
orders), built on the host once per distinct grid and joined per batch.

transformers' `vision_utils` functions compute these for a whole packed batch on every call: dozens of small tensor ops
over every patch (sixteen taps each for a bicubic table), in the main process, for every batch. Each of these inputs is
a function of one image's grid alone, up to an offset where it indexes the packed sequence, so an image's part is
computed once per grid (`PerGrid`, least recently used first out) and a batch's inputs are the parts joined (a
concatenation, and that offset added by the family). Photos come in few sizes, so nearly every image is a hit; a miss
costs one image's share. `interpolation_taps` builds an image's taps from its two axes' (a row's and a column's) rather
than patch by patch: the same operations on the same values as transformers' batched function, so the same numbers
(tests/towers/test_grids.py checks them equal, bit for bit).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

Grid = tuple[int, int, int]
"""(t, h, w) of one image, in patches."""

MAX_PATCHES = 1 << 20
"""Patches whose inputs a PerGrid keeps (about 200 MB with a bicubic table's sixteen taps a patch)."""


class PerGrid:
    """`compute(grid)` (a dict of an image's tensors, rows per patch) kept for the grids seen most recently."""

    def __init__(self, compute: Callable[[Grid], dict], max_patches: int = MAX_PATCHES):
        self.compute, self.max_patches = compute, max_patches
        self.kept: OrderedDict[Grid, dict] = OrderedDict()
        self.patches = 0

    def __call__(self, grid_thw: torch.Tensor) -> list[dict]:
        """Each image's inputs, in the batch's order (grid_thw on the host)."""
        return [self._of(tuple(grid)) for grid in grid_thw.tolist()]

    def _of(self, grid: Grid) -> dict:
        if (found := self.kept.get(grid)) is not None:
            self.kept.move_to_end(grid)
            return found
        parts = self.compute(grid)
        self.kept[grid] = parts
        self.patches += patches_of(grid)
        while self.patches > self.max_patches and len(self.kept) > 1:
            old, _ = self.kept.popitem(last=False)
            self.patches -= patches_of(old)
        return parts


def patches_of(grid: Grid) -> int:
    t, h, w = grid
    return t * h * w


def joined(parts: list[dict], name: str) -> torch.Tensor:
    return torch.cat([part[name] for part in parts])


def axis_taps(size: int, side: int, mode: str, align_corners: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Taps into a `side`-long table axis, and their weights, for each of `size` positions: as F.interpolate resamples
    (half-pixel centres unless `align_corners`; 2 taps bilinear, 4 bicubic with Keys' a=-0.75), edges clamped."""
    index = torch.arange(size, dtype=torch.float32)
    length = torch.full((size,), size)
    if align_corners:
        source = index * (side - 1) / torch.clamp(length - 1, min=1)
    else:
        source = (index + 0.5) * side / length - 0.5
    floor = torch.floor(source)
    offsets = torch.arange(0, 2) if mode == "bilinear" else torch.arange(-1, 3)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    distance = (source[:, None] - floor[:, None] - offsets).abs()
    if mode == "bilinear":
        return taps, (1 - distance).clamp(min=0)
    a = -0.75
    near = ((a + 2) * distance - (a + 3)) * distance * distance + 1
    far = ((a * distance - 5 * a) * distance + 8 * a) * distance - 4 * a
    return taps, torch.where(distance <= 1, near, far)


def interpolation_taps(grid: Grid, side: int, mode: str, align_corners: bool,
                       merge_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """One image's (patches, taps) indices into a square `side` x `side` table flattened, and weights: a row's taps
    times a column's, the patches in raster order (merge_size 1) or by merge window, repeated over the t frames."""
    t, h, w = grid
    rows, row_weights = axis_taps(h, side, mode, align_corners)
    columns, column_weights = axis_taps(w, side, mode, align_corners)
    n = rows.shape[1]
    indices = rows[:, None, :, None] * side + columns[None, :, None, :]  # (h, w, n, n)
    weights = row_weights[:, None, :, None] * column_weights[None, :, None, :]
    if merge_size > 1:
        m = merge_size
        indices, weights = (x.reshape(h // m, m, w // m, m, n, n).transpose(1, 2) for x in (indices, weights))
    return indices.reshape(-1, n * n).repeat(t, 1), weights.reshape(-1, n * n).repeat(t, 1)
