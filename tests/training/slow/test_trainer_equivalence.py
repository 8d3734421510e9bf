"""The guarantee the Parquet output exists to give: a trainer that scatters the stored embeddings into
inputs_embeds (with the stored M-RoPE positions for Qwen) gets the logits of the full model fed pixels."""

from __future__ import annotations

import inspect

import pytest
import torch
from conftest import all_families, embed_in_process
from hf_models import pretrained
from transformers import AutoConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

from batchvlm.families import ModelConfig
from batchvlm.pipeline.decode import DecodeConfig
from batchvlm.pipeline.decode import decode_image
from batchvlm.demo import demo_rows
from batchvlm.families import load_family
from batchvlm.training.reader import read_run
from batchvlm.format.schema import IMAGE

# the job, then the full models
pytestmark = pytest.mark.slow


def logits_from_stored(model, record) -> torch.Tensor:
    ids = record.input_ids[None]
    embeds = model.get_input_embeddings()(ids)
    embeds[0, record.image_token_positions()] = record.image_embeds.to(embeds.dtype)
    positions = record.position_ids[:, None, :] if record.position_ids is not None else None
    return model(inputs_embeds=embeds, position_ids=positions).logits


def logits_from_pixels(model, family, record, images) -> torch.Tensor:
    pixel_values, grid_thw = family.reference_preprocess(images)
    # Qwen-VL computes its M-RoPE positions from which tokens are images; the others find the image tokens by id
    takes_types = "mm_token_type_ids" in inspect.signature(model.forward).parameters
    extra = {"mm_token_type_ids": (record.token_tags == IMAGE).long()[None]} if takes_types else {}
    return model(input_ids=record.input_ids[None], pixel_values=pixel_values, image_grid_thw=grid_thw, **extra).logits


@pytest.mark.parametrize("family_name", all_families())
def test_stored_embeddings_give_the_full_models_logits(tmp_path, family_name):
    family = load_family(ModelConfig(family=family_name))
    model_type = AutoConfig.from_pretrained(family.checkpoint).model_type
    if model_type not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        pytest.skip(f"{family_name}: its checkpoint ({model_type}) has no language model to feed")
    # The reference backend feeds the tower the processor's own pixels, so only the stored output is under test.
    embed_in_process(tmp_path, "train", f"model.family={family_name}", "output.embed_dtype=float32",
                     "preprocess.backend=reference")
    model = pretrained(family.checkpoint, dtype=torch.float32)
    rows = {row["id"]: row for row in demo_rows()}
    checked = 0
    with torch.inference_mode():
        for record in read_run(tmp_path / "train"):
            if not len(record.grid_thw):
                continue
            images = [decode_image(blob, DecodeConfig()).pixels for blob in rows[record.id]["images"]]
            expected = logits_from_pixels(model, family, record, images)
            ours = logits_from_stored(model, record)
            assert ours.shape == expected.shape
            assert (ours - expected).abs().max() <= 1e-4 * expected.abs().max() + 1e-5, record.id
            checked += 1
    assert checked >= 15
