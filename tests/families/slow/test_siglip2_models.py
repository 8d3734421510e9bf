"""siglip2's packed forward against HF's padded forward on each image alone."""

from __future__ import annotations

import pytest
import torch
from hf_models import pretrained
from transformers import Siglip2Model

from photos import demo_images, photo_of_size, preprocessed

import test_siglip2

# the HF model run image by image
pytestmark = pytest.mark.slow
siglip = test_siglip2.siglip  # test_siglip2.py's fixture (built again here, in under a second)


def test_packed_forward_equals_the_hf_padded_forward_on_each_image_alone(siglip):
    """Patch tokens and pooled vectors (fp32) of a packed batch of very different sizes."""
    reference = pretrained(siglip.checkpoint, Siglip2Model, dtype=torch.float32).vision_model
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
