"""Every family's packed embeddings in half precision, and a base-size tower in bf16, against the HF model on each image
alone."""

from __future__ import annotations

import pytest
import torch

from hf_models import pretrained
from photos import photo_of_size, preprocessed

# three models of each family, and a ViT-B-sized tower
pytestmark = pytest.mark.slow


# -- half precision: every family's tower in bf16 and fp16, packed, against the HF model on each image alone ----------
HALF_TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 4e-3}
"""Largest difference allowed, as a fraction of the reference's largest magnitude: about 8 units in the last place of
each dtype (bf16 2^-8, fp16 2^-11). Measured on the tiny towers (no norm or bias left at its init), packed against the
HF model run on each image alone in the same dtype: bf16 up to 1.1e-2, fp16 up to 8.2e-4 (both siglip2, whose oracle
pads to the patch budget under a mask; kimi_k25 and qwen2_vl 0); against that model in fp32: bf16 1.0e-2 (siglip2;
kimi_k25 3.6e-3, qwen2_vl 3.8e-3) and fp16 1.3e-3."""


def hf_alone(family, dtype: torch.dtype):
    """The Hugging Face model of the family's checkpoint, in `dtype`, on one image at a time: (rows, grid) -> tokens.
    The oracle casts the pixel values to its dtype itself, as a user of that model does."""
    from transformers import AutoConfig, Kimi_K25ForConditionalGeneration, Siglip2Model

    model_type = AutoConfig.from_pretrained(family.checkpoint).model_type
    if model_type == "kimi_k25":
        model = pretrained(family.checkpoint, Kimi_K25ForConditionalGeneration, dtype=dtype)
        return lambda rows, grid: model.get_image_features(rows.to(dtype), torch.tensor([grid])).pooler_output[0]
    if model_type.startswith("qwen"):
        model = pretrained(family.checkpoint, dtype=dtype)
        return lambda rows, grid: model.model.get_image_features(rows, torch.tensor([grid])).pooler_output[0]
    model = pretrained(family.checkpoint, Siglip2Model, dtype=dtype).vision_model
    budget = family.params.max_num_patches

    def padded_forward(rows, grid):
        _, h, w = grid
        padded = torch.zeros(1, budget, rows.shape[1], dtype=dtype)
        padded[0, :h * w] = rows
        mask = (torch.arange(budget) < h * w)[None].long()
        return model(pixel_values=padded, pixel_attention_mask=mask,
                     spatial_shapes=torch.tensor([[h, w]])).last_hidden_state[0, :h * w]

    return padded_forward


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return float((ours.float() - reference.float()).abs().max() / reference.float().abs().max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_packed_embeddings_in_half_precision_equal_the_hf_model_on_each_image_alone(family, dtype):
    # small real photos of different shapes (a CPU's half precision is slow), thin and tiny ones among them
    photos = [photo_of_size(h, w) for h, w in ((84, 140), (140, 84), (112, 112), (30, 800), (2, 2))]
    rows, grids = preprocessed(family, photos)
    packed = family.load_encoder(torch.device("cpu"), dtype)(torch.cat(rows), torch.tensor(grids))["image_embeds"]
    alone, exact = hf_alone(family, dtype), hf_alone(family, torch.float32)
    with torch.inference_mode():
        for index, (image_rows, grid) in enumerate(zip(rows, grids)):
            reference = alone(image_rows, grid)
            assert packed[index].dtype == dtype and packed[index].shape == reference.shape, index
            assert relative_error(packed[index], reference) <= HALF_TOLERANCE[dtype], index
            assert relative_error(packed[index], exact(image_rows, grid)) <= HALF_TOLERANCE[dtype], index


def test_a_base_size_tower_in_bf16_packed_equals_the_hf_tower_on_each_image_alone(kimi_family):
    """The size the e2e bench and the GPU check time (kimi_k25.BASE_VISION), built from its config with a fixed seed
    in bf16; small images keep it quick on a CPU."""
    from transformers import Kimi_K25VisionModel

    from batchvlm.families.kimi_k25 import BASE_VISION, KimiEncoder, hf_config, released_config

    config = hf_config(released_config(BASE_VISION, kimi_family.tokenizer), kimi_family.checkpoint).vision_config
    torch.manual_seed(0)
    tower = Kimi_K25VisionModel._from_config(config, dtype=torch.bfloat16).eval()
    encoder = KimiEncoder(tower, None, merge_size=2, keep_tower=False, attention="sdpa")
    rows, grids = preprocessed(kimi_family, [photo_of_size(56, 84), photo_of_size(56, 56), photo_of_size(28, 28)])
    packed = encoder(torch.cat(rows), torch.tensor(grids))["image_embeds"]
    with torch.inference_mode():
        for index, (image_rows, grid) in enumerate(zip(rows, grids)):
            alone = tower(image_rows.to(torch.bfloat16), grid_thw=torch.tensor([grid])).pooler_output.flatten(1)
            assert packed[index].dtype == torch.bfloat16
            assert relative_error(packed[index], alone) <= HALF_TOLERANCE[torch.bfloat16], index
