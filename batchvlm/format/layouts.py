"""Patch layouts: how a normalized image becomes the rows a family's tower takes.

Three layouts cover the families, as their Hugging Face image processors lay the patches out (transformers'
Kimi_K25ImageProcessor, Qwen2VLImageProcessor, Siglip2ImageProcessor: github.com/huggingface/transformers). A layout
is data, not code in the family, so every preprocessing backend (torch ops here, Triton kernels in kernels/)
writes the same rows from the same description.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

RASTER_CHW = "raster_chw"
"""Kimi MoonViT: rows in raster order over (gh, gw), each row a (C, p, p) patch."""
MERGE_WINDOW = "merge_window"
"""Qwen2/2.5/3-VL: rows grouped by m x m merge window, each row (C, tps, p, p) flattened."""
RASTER_HWC = "raster_hwc"
"""SigLIP2 NaFlex: rows in raster order, each row (p, p, C) flattened (channels last)."""


@dataclass(frozen=True)
class PatchLayout:
    kind: str
    patch_size: int
    merge_size: int = 1
    temporal_patch_size: int = 1
    channels: int = 3

    @property
    def row_shape(self) -> tuple[int, ...]:
        c, p, tps = self.channels, self.patch_size, self.temporal_patch_size
        if self.kind == RASTER_CHW:
            return (c, p, p)
        return (c * tps * p * p,)

    def patchify(self, image: torch.Tensor) -> torch.Tensor:
        """CHW image whose sides are whole patches (and merge windows, where the layout has them) -> rows."""
        c, h, w = image.shape
        p = self.patch_size
        gh, gw = h // p, w // p
        if self.kind == RASTER_CHW:
            return image.reshape(c, gh, p, gw, p).permute(1, 3, 0, 2, 4).reshape(gh * gw, c, p, p)
        if self.kind == RASTER_HWC:
            return image.reshape(c, gh, p, gw, p).permute(1, 3, 2, 4, 0).reshape(gh * gw, p * p * c)
        # A still image is one frame repeated tps times (t = 1).
        return self.patchify_frames(image[None].expand(self.temporal_patch_size, c, h, w))

    def patchify_frames(self, frames: torch.Tensor) -> torch.Tensor:
        """TCHW frames (T whole temporal patches) -> rows, temporal patch by temporal patch: merge_window's in
        merge-window order; a layout without temporal patches takes each frame as an image (SigLIP2's NaFlex frames)."""
        if self.kind != MERGE_WINDOW:
            return torch.cat([self.patchify(frame) for frame in frames])
        t, c, h, w = frames.shape
        p, m, tps = self.patch_size, self.merge_size, self.temporal_patch_size
        gt, gh, gw = t // tps, h // p, w // p
        windows = frames.reshape(gt, tps, c, gh // m, m, p, gw // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
        return windows.reshape(gt * gh * gw, c * tps * p * p)
