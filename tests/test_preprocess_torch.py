"""The torch backend's fast path (uint8 until the rows, normalized where the values are fewest) against the
pixel contract written out step by step in float (kernels/reference.py, the Triton kernels' oracle)."""

from __future__ import annotations

import pytest
import torch

from batchvlm.bench.tasks import image_mix
from batchvlm.kernels.reference import normalized_image
from batchvlm.pipeline.preprocess import TorchPreprocessor
from batchvlm.records import DecodedImage


@pytest.mark.parametrize("background", ["black", "chessboard"])
def test_torch_rows_equal_the_float_reference_bit_for_bit(family, background):
    """Every family, on kept sizes, down- and upscales, padding, a thin strip and column, and RGBA."""
    preprocessor = TorchPreprocessor(family, torch.device("cpu"), background)
    mix = image_mix()
    coffee = dict(mix)["coffee"]
    height, width = family.plan(*coffee.shape[:2]).resized
    resized_or_not = set()
    for name, pixels in mix + [("coffee_at_its_planned_size", coffee[:height, :width].copy())]:
        image = DecodedImage(pixels, "PNG", "")
        plan = family.plan(image.height, image.width)
        resized_or_not.add(plan.resized == (image.height, image.width))
        rows, grid = preprocessor.image_rows(image, plan)
        expected = family.patchify(normalized_image(torch.from_numpy(pixels), plan.resized, plan.padded,
                                                    family.resample, background, preprocessor.scale,
                                                    preprocessor.bias))
        assert grid == (1, plan.padded[0] / family.layout.patch_size, plan.padded[1] / family.layout.patch_size)
        assert rows.dtype == torch.float32 and torch.equal(rows, expected), name
    assert resized_or_not == {True, False}, "the mix must hold kept and resized images"
