"""siglip2 (NaFlex) against the reference's worked examples and HF's padded forward, image by image."""

from __future__ import annotations

import pytest
import torch
from transformers import Siglip2VisionModel

from photos import demo_images, photo_of_size, preprocessed

from batchvlm.config import ModelConfig
from batchvlm.families import load_family
from batchvlm.families.siglip2 import naflex_size


@pytest.fixture(scope="module")
def siglip():
    return load_family(ModelConfig(family="siglip2"))


@pytest.mark.parametrize("width,height,budget,size", [
    (1920, 1080, 256, (192, 336)),
    (64, 64, 256, (256, 256)),  # a 4x upscale
    (1920, 1080, 1024, (384, 672)),
])
def test_naflex_size_matches_the_worked_examples(width, height, budget, size):
    assert naflex_size(height, width, 16, budget) == size


@pytest.mark.slow
def test_packed_forward_equals_the_hf_padded_forward_on_each_image_alone(siglip):
    """Patch tokens and pooled vectors (fp32) of a packed batch of very different sizes."""
    reference = Siglip2VisionModel.from_pretrained(siglip.checkpoint, dtype=torch.float32).eval()
    encoder = siglip.load_encoder(torch.device("cpu"), torch.float32)
    photos = [p for _, p in demo_images()[:6]] + [photo_of_size(30, 4000), photo_of_size(1, 1)]
    rows, grids = preprocessed(siglip, photos)
    packed = encoder(torch.cat(rows), torch.tensor(grids))
    budget = siglip.params.max_num_patches
    with torch.inference_mode():
        for index, (image_rows, (_, h, w)) in enumerate(zip(rows, grids)):
            padded = torch.zeros(1, budget, image_rows.shape[1])
            padded[0, :h * w] = image_rows
            mask = (torch.arange(budget) < h * w)[None].long()
            alone = reference(pixel_values=padded, pixel_attention_mask=mask, spatial_shapes=torch.tensor([[h, w]]))
            tokens = packed["image_embeds"][index]
            assert tokens.shape == (h * w, encoder.hidden_size)
            assert torch.allclose(tokens, alone.last_hidden_state[0, :h * w], rtol=1e-4, atol=1e-5)
            assert torch.allclose(packed["pooled_embeds"][index], alone.pooler_output, rtol=1e-4, atol=1e-5)


def test_packed_batches_carry_no_padding_rows_where_the_processor_pads(siglip):
    """Packing efficiency on the demo photos: real patches / rows the tower is given."""
    from batchvlm.families import processor_inputs

    photos = [p for _, p in demo_images()]
    rows, grids = preprocessed(siglip, photos)
    real = sum(h * w for _, h, w in grids)
    assert sum(image_rows.shape[0] for image_rows in rows) == real
    padded = siglip.reference_processor()(images=processor_inputs(photos), return_tensors="pt")["pixel_values"]
    hf_rows = padded.shape[0] * padded.shape[1]
    print(f"siglip2 demo: packed {real}/{real} = 1.000, HF padded {real}/{hf_rows} = {real / hf_rows:.3f}")
    assert real < hf_rows
