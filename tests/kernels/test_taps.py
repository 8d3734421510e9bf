"""The filter taps are PIL's antialiased resampling filters: applied as a matrix they give PIL's own resize."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from batchvlm.kernels.taps import filter_taps, max_taps

PIL_FILTERS = {"bicubic": Image.Resampling.BICUBIC, "bilinear": Image.Resampling.BILINEAR}


@pytest.mark.parametrize("resample", sorted(PIL_FILTERS))
@pytest.mark.parametrize("in_size,out_size", [(37, 11), (11, 37), (300, 7), (16, 16)])
def test_the_taps_resize_a_row_as_pil_does_in_float(resample, in_size, out_size):
    row = np.random.default_rng(in_size).uniform(0, 255, in_size).astype(np.float32)
    start, weights = filter_taps(in_size, out_size, resample, max_taps(in_size, out_size, resample))
    ours = np.zeros(out_size, np.float64)
    for index, (first, taps) in enumerate(zip(start, weights)):
        window = row[first:first + len(taps)]
        ours[index] = float(np.dot(window, taps[:len(window)]))
    pil = np.asarray(Image.fromarray(row[None, :], mode="F").resize((out_size, 1), PIL_FILTERS[resample]))[0]
    assert np.abs(ours - pil).max() < 1e-2
