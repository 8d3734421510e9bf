"""kimi_k25 against oracles nobody here wrote: the HF image processor and the HF model's own forward."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from skimage import data
from transformers import Kimi_K25ForConditionalGeneration

from batchvlm.config import DecodeConfig
from batchvlm.decode import decode_image
from batchvlm.demo import demo_rows
from batchvlm.families.kimi_k25 import KimiProcessorParams, navit_plan
from batchvlm.preprocess import TorchPreprocessor
from batchvlm.records import DecodedImage

# Torch's antialiased bicubic vs the processor's uint8 (PIL-semantics) kernel: measured max 2 levels,
# mean <= 0.002 levels on real photos (retina, hubble, coffee tiles).
PIXEL_MAX_LEVELS = 2.0
PIXEL_MEAN_LEVELS = 0.01


def demo_images() -> list[tuple[str, np.ndarray]]:
    images = []
    for row in demo_rows():
        for index, blob in enumerate(row["images"]):
            try:
                images.append((f"{row['id']}[{index}]", decode_image(blob, DecodeConfig()).pixels))
            except Exception:
                continue  # the demo's deliberately bad images
    return images


def large_photos() -> list[tuple[str, np.ndarray]]:
    """Real photos big enough that the resize rule scales them down (the demo's are all within budget)."""
    retina, hubble, coffee = data.retina(), data.hubble_deep_field(), data.coffee()
    return [("retina_wide", np.concatenate([retina, retina], 1)), ("retina_tall", np.concatenate([retina, retina], 0)),
            ("hubble_tiled", np.tile(hubble, (3, 2, 1))), ("coffee_strip", np.tile(coffee, (1, 14, 1)))]


@pytest.mark.parametrize("width,height,grid,resized", [
    (1920, 1080, (1, 78, 138), (1080, 1920)),
    (4000, 3000, (1, 112, 150), (1554, 2073)),
    (8000, 8000, (1, 130, 130), (1793, 1793)),
    (100000, 10, (1, 2, 512), (1, 7167)),
    (1, 1, (1, 2, 2), (1, 1)),
])
def test_navit_plan_matches_the_worked_examples(width, height, grid, resized):
    plan = navit_plan(height, width, KimiProcessorParams())
    assert plan.grid_thw == grid and plan.resized == resized
    assert plan.num_tokens == grid[1] * grid[2] // 4


def test_planned_grids_equal_the_hf_processor_for_every_demo_image(kimi_family):
    images = demo_images() + large_photos()
    assert len(images) >= 20
    for name, pixels in images:
        _, grid = kimi_family.reference_preprocess([pixels])
        plan = kimi_family.plan(*pixels.shape[:2])
        assert tuple(grid[0].tolist()) == plan.grid_thw, name


def test_torch_pixels_match_the_hf_processor_within_two_levels(kimi_family):
    preprocessor = TorchPreprocessor(kimi_family, torch.device("cpu"), "black")
    for name, pixels in demo_images() + large_photos():
        image = DecodedImage(pixels[..., :3].copy(), "PNG", "")
        ours, _ = preprocessor.image_rows(image, kimi_family.plan(image.height, image.width))
        reference, _ = kimi_family.reference_preprocess([image.pixels])
        assert ours.shape == reference.shape, name
        levels = (ours - reference).abs() * 127.5  # mean = std = 0.5: one uint8 level is 1/127.5
        assert levels.max() <= PIXEL_MAX_LEVELS + 1e-3, name
        assert levels.mean() <= PIXEL_MEAN_LEVELS, name


def test_non_square_images_are_not_transposed(kimi_family):
    """The processor bug of early commits transposed W and H; the pinned version and ours agree."""
    photo = data.coffee()[:200, :400]  # 200 tall, 400 wide
    pixel_values, grid = kimi_family.reference_preprocess([photo])
    assert tuple(grid[0].tolist()) == (1, 16, 30)
    preprocessor = TorchPreprocessor(kimi_family, torch.device("cpu"), "black")
    ours, _ = preprocessor.image_rows(DecodedImage(photo.copy(), "PNG", ""), kimi_family.plan(200, 400))
    assert torch.allclose(ours, pixel_values, atol=1e-5)


def test_packed_embeddings_equal_the_hf_model_run_on_each_image_alone(kimi_family):
    """Many very different sizes in one packed batch vs the full HF model's get_image_features, image by image."""
    encoder = kimi_family.load_encoder(torch.device("cpu"), torch.float32)
    reference = Kimi_K25ForConditionalGeneration.from_pretrained(kimi_family.checkpoint, dtype=torch.float32).eval()
    preprocessor = TorchPreprocessor(kimi_family, torch.device("cpu"), "black")
    photos = [p for _, p in demo_images()[:8]] + [data.rocket()[150:230], data.chelsea()[140:160, 200:220]]
    rows, grids = [], []
    for pixels in photos:
        image = DecodedImage(pixels[..., :3].copy(), "PNG", "")
        image_rows, _ = preprocessor.image_rows(image, plan := kimi_family.plan(image.height, image.width))
        rows.append(image_rows)
        grids.append(plan.grid_thw)
    packed = encoder(torch.cat(rows), torch.tensor(grids))
    with torch.inference_mode():
        for image_rows, grid, ours in zip(rows, grids, packed):
            alone = reference.get_image_features(image_rows, torch.tensor([grid])).pooler_output[0]
            assert ours.shape == alone.shape
            scale = alone.abs().max()
            assert (ours - alone).abs().max() <= 1e-4 * scale + 1e-6
