"""Every family against its Hugging Face image processor (the oracle): grids, token counts and pixels."""

from __future__ import annotations

import pytest
import torch

from photos import demo_images, large_photos, photo_of_size, uint8_levels

from batchvlm.checks import CheckFailed
from batchvlm.pipeline.preprocess import TorchPreprocessor
from batchvlm.records import DecodedImage

# On the CPU the torch backend resizes with torch's uint8 kernel, as the processors do: measured max
# 3e-5 levels (float rounding of the normalization) for every family. The GPU's two float passes stay
# within 2 levels of it (tests/kernels/test_pack_pixels.py), the Triton kernels within 1 level of those.
PIXEL_MAX_LEVELS = 0.01
PIXEL_MEAN_LEVELS = 0.001


def extreme_sizes(family) -> list[tuple[int, int]]:
    """(height, width): tiny, thin, wide, exactly on the family's size boundary, just over its budget."""
    factor = family.layout.patch_size * family.layout.merge_size
    return [(1, 1), (1, 300), (300, 1), (30, 4000), (factor * 3, factor * 5), family.just_over_budget()]


def named_images(family):
    sized = [(f"{h}x{w}", photo_of_size(h, w)) for h, w in extreme_sizes(family)]
    return demo_images() + large_photos() + sized


def reference_or_rejection(family, pixels):
    try:
        return family.reference_preprocess([pixels])
    except ValueError as error:  # e.g. Qwen's processor refuses aspect ratios over 200
        return error


def test_families_are_found_by_module_name_and_a_users_own_by_its_path():
    from conftest import PLUGIN_FAMILY

    from batchvlm.families import ModelConfig
    from batchvlm.families import family_names, load_family

    assert family_names() == ["kimi_k25", "qwen2_vl", "siglip2"]  # every module of batchvlm/families but the shared
    assert load_family(ModelConfig(family=PLUGIN_FAMILY)).name == PLUGIN_FAMILY


def test_planned_grids_and_token_counts_equal_the_hf_processor(family):
    for name, pixels in named_images(family):
        reference = reference_or_rejection(family, pixels)
        if isinstance(reference, ValueError):
            with pytest.raises(CheckFailed) as refused:
                family.plan(*pixels.shape[:2])
            assert refused.value.check == "plan.size_rule", name
            continue
        _, grid = reference
        plan = family.plan(*pixels.shape[:2])
        assert tuple(grid[0].tolist()) == plan.grid_thw, name
        assert plan.num_tokens == int(grid[0].prod()) // family.layout.merge_size ** 2, name


def test_torch_pixels_equal_the_hf_processor(family):
    preprocessor = TorchPreprocessor(family, torch.device("cpu"), "black")
    for name, pixels in named_images(family):
        if isinstance(reference := reference_or_rejection(family, pixels), ValueError):
            continue
        image = DecodedImage(pixels[..., :3].copy(), "PNG", "")
        ours, _ = preprocessor.image_rows(image, family.plan(image.height, image.width))
        assert ours.shape == reference[0].shape, name
        levels = uint8_levels(family, ours, reference[0])
        assert levels.max() <= PIXEL_MAX_LEVELS, name
        assert levels.mean() <= PIXEL_MEAN_LEVELS, name
