"""PIL's antialiased resampling filters as tables: for each output pixel of one axis, the first
input pixel it reads and the normalized weights of the pixels from there on.

This is the filter of `PIL.Image.resize` and of torch's `interpolate(..., antialias=True)` (which
follows PIL): the support widens by the downscale factor so every input pixel contributes, the
window is clipped at the borders and the weights renormalized. Bicubic uses a = -0.5 (PIL's), not
the -0.75 of torch's plain bicubic.
"""

from __future__ import annotations

import math

import numpy as np

# Half-width of each filter at scale 1, in input pixels.
SUPPORT = {"bicubic": 2.0, "bilinear": 1.0}


def _bicubic(x: np.ndarray) -> np.ndarray:
    a = -0.5
    x = np.abs(x)
    near = ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
    far = (((x - 5.0) * x + 8.0) * x - 4.0) * a
    return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


def _triangle(x: np.ndarray) -> np.ndarray:
    return np.clip(1.0 - np.abs(x), 0.0, None)


FILTERS = {"bicubic": _bicubic, "bilinear": _triangle}


def max_taps(in_size: int, out_size: int, resample: str) -> int:
    """Widest window of the axis: the width of the weight table."""
    if in_size == out_size:
        return 1
    return int(math.ceil(SUPPORT[resample] * max(in_size / out_size, 1.0))) * 2 + 1


def filter_taps(in_size: int, out_size: int, resample: str, width: int) -> tuple[np.ndarray, np.ndarray]:
    """(start [out_size] int64, weights [out_size, width] float32) of one axis, zero-padded to `width`.

    An axis that keeps its size is the identity (one tap of weight 1), as it is for PIL and torch,
    which skip that pass.
    """
    if in_size == out_size:
        weights = np.zeros((out_size, width), np.float32)
        weights[:, 0] = 1.0
        return np.arange(out_size, dtype=np.int64), weights
    # The arithmetic of torch's _compute_weights_aa (UpSampleKernel.cpp), in double precision like PIL's.
    scale = in_size / out_size
    support = SUPPORT[resample] * max(scale, 1.0)
    inv_scale = 1.0 / scale if scale >= 1.0 else 1.0
    center = scale * (np.arange(out_size) + 0.5)
    start = np.maximum((center - support + 0.5).astype(np.int64), 0)
    stop = np.minimum((center + support + 0.5).astype(np.int64), in_size)
    offsets = np.arange(width)
    source = start[:, None] + offsets[None, :]
    weights = FILTERS[resample]((source - center[:, None] + 0.5) * inv_scale)
    weights = np.where(source < stop[:, None], weights, 0.0)
    total = weights.sum(axis=1, keepdims=True)
    weights = np.divide(weights, total, out=np.zeros_like(weights), where=total != 0)
    return start, weights.astype(np.float32)
