"""kimi_k25 against oracles nobody here wrote: the HF image processor and the HF model's own forward."""

from __future__ import annotations

import pytest
import torch
from skimage import data
from transformers import Kimi_K25ForConditionalGeneration

from photos import demo_images, preprocessed

from batchvlm.families.kimi_k25 import KimiProcessorParams, navit_plan


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


def test_non_square_images_are_not_transposed(kimi_family):
    """The processor bug of early commits transposed W and H; the pinned version and ours agree."""
    photo = data.coffee()[:200, :400]  # 200 tall, 400 wide
    pixel_values, grid = kimi_family.reference_preprocess([photo])
    assert tuple(grid[0].tolist()) == (1, 16, 30)
    (ours,), _ = preprocessed(kimi_family, [photo])
    assert torch.allclose(ours, pixel_values, atol=1e-5)


@pytest.mark.slow
def test_packed_embeddings_equal_the_hf_model_run_on_each_image_alone(kimi_family):
    """Many very different sizes in one packed batch vs the full HF model's get_image_features, image by image."""
    encoder = kimi_family.load_encoder(torch.device("cpu"), torch.float32)
    reference = Kimi_K25ForConditionalGeneration.from_pretrained(kimi_family.checkpoint, dtype=torch.float32).eval()
    photos = [p for _, p in demo_images()[:8]] + [data.rocket()[150:230], data.chelsea()[140:160, 200:220]]
    rows, grids = preprocessed(kimi_family, photos)
    packed = encoder(torch.cat(rows), torch.tensor(grids))["image_embeds"]
    with torch.inference_mode():
        for image_rows, grid, ours in zip(rows, grids, packed):
            alone = reference.get_image_features(image_rows, torch.tensor([grid])).pooler_output[0]
            assert ours.shape == alone.shape
            scale = alone.abs().max()
            assert (ours - alone).abs().max() <= 1e-4 * scale + 1e-6


def test_a_sharded_moe_checkpoint_yields_its_own_tower_and_projector(tmp_path, kimi_family):
    """Loaded with no LLM layers and a one-token vocabulary, the vision weights still come through
    transformers' conversion exactly; the packed output equals the full model's."""
    import json

    from transformers import AutoConfig

    from batchvlm.families import ModelConfig
    from batchvlm.families import load_family

    config = AutoConfig.from_pretrained(kimi_family.checkpoint)
    config.text_config.num_hidden_layers = 3  # layers 1 and 2 are mixture-of-experts layers
    torch.manual_seed(1)
    full = Kimi_K25ForConditionalGeneration(config).eval()
    full.save_pretrained(tmp_path, max_shard_size="100KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    kimi_family.tokenizer.save_pretrained(tmp_path)
    processor = json.loads((kimi_family.checkpoint / "preprocessor_config.json").read_text())
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(processor))
    family = load_family(ModelConfig(path=str(tmp_path)))
    encoder = family.load_encoder(torch.device("cpu"), torch.float32)
    rows, grids = preprocessed(family, [data.coffee()[:200, :300]])
    with torch.inference_mode():
        ours = encoder(rows[0], torch.tensor(grids))["image_embeds"][0]
        expected = full.get_image_features(rows[0], torch.tensor(grids)).pooler_output[0]
    assert torch.allclose(ours, expected, rtol=1e-5, atol=1e-6)
