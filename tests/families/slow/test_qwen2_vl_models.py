"""qwen2_vl's packed embeddings against the HF models on each image alone, and stored Qwen3-VL outputs with deepstack
against the full model's logits."""

from __future__ import annotations

import pytest
import torch
from transformers import (Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration,
                          Qwen3VLForConditionalGeneration)

from photos import demo_images, photo_of_size, preprocessed

from batchvlm.families import ModelConfig
from batchvlm.families import load_family
from test_qwen2_vl import _tiny_variant, qwen2_5_config, qwen3_config
import test_qwen2_vl

# HF models run image by image
pytestmark = pytest.mark.slow
qwen = test_qwen2_vl.qwen  # test_qwen2_vl.py's fixture (built again here, in under a second)


def test_qwen2_vl_packed_embeddings_equal_the_hf_model_on_each_image_alone(qwen):
    _assert_packed_equals_alone(qwen, Qwen2VLForConditionalGeneration.from_pretrained(qwen.checkpoint))


@pytest.mark.parametrize("make_config", [qwen2_5_config, qwen3_config], ids=["qwen2_5_vl", "qwen3_vl"])
def test_later_versions_packed_embeddings_equal_the_hf_model_on_each_image_alone(tmp_path, qwen, make_config):
    config = make_config(qwen)
    _tiny_variant(tmp_path, qwen, config)
    family = load_family(ModelConfig(family="qwen2_vl", path=str(tmp_path)))
    assert family.version == config.model_type
    model = {"qwen2_5_vl": Qwen2_5_VLForConditionalGeneration, "qwen3_vl": Qwen3VLForConditionalGeneration}[
        config.model_type].from_pretrained(tmp_path)
    _assert_packed_equals_alone(family, model)


def _assert_packed_equals_alone(family, model) -> None:
    """Very different sizes in one packed batch vs the full model's get_image_features, image by image (fp32)."""
    model = model.float().eval()
    encoder = family.load_encoder(torch.device("cpu"), torch.float32)
    photos = [p for _, p in demo_images()[:6]] + [photo_of_size(30, 800), photo_of_size(2, 2)]
    rows, grids = preprocessed(family, photos)
    packed = encoder(torch.cat(rows), torch.tensor(grids))
    with torch.inference_mode():
        for index, (image_rows, grid) in enumerate(zip(rows, grids)):
            alone = model.model.get_image_features(image_rows, torch.tensor([grid]))
            expected = alone.pooler_output[0]
            ours = packed["image_embeds"][index]
            assert ours.shape == expected.shape
            assert (ours - expected).abs().max() <= 1e-4 * expected.abs().max() + 1e-6
            if "deepstack_embeds" in packed:
                stacked = torch.cat([layer[0] for layer in alone.deepstack_features], dim=-1)
                assert torch.allclose(packed["deepstack_embeds"][index], stacked, rtol=1e-4, atol=1e-5)


def test_stored_qwen3_outputs_with_deepstack_give_the_full_models_logits(tmp_path, qwen):
    """The trainer's side for Qwen3-VL: stored merger tokens and deepstack features, handed to the model as
    its encoder outputs with the stored M-RoPE positions, give the logits of the model fed the pixels."""
    from conftest import embed_in_process
    from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

    from batchvlm.pipeline.decode import DecodeConfig
    from batchvlm.pipeline.decode import decode_image
    from batchvlm.demo import demo_rows
    from batchvlm.training.reader import read_run
    from batchvlm.format.schema import IMAGE

    checkpoint = tmp_path / "qwen3"
    _tiny_variant(checkpoint, qwen, qwen3_config(qwen))
    embed_in_process(tmp_path, "q3", "model=qwen3_vl", f"model.path={checkpoint}", "model.dtype=float32",
                     "output.embed_dtype=float32", "preprocess.backend=reference", "dataset.limit=6")
    family = load_family(ModelConfig(family="qwen2_vl", path=str(checkpoint)))
    model = Qwen3VLForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    rows = {row["id"]: row for row in demo_rows()}
    checked = 0
    with torch.inference_mode():
        for record in read_run(tmp_path / "q3"):
            if not len(record.grid_thw):
                continue
            layers = record.extras["deepstack_embeds"].chunk(len(model.config.vision_config.deepstack_visual_indexes), -1)
            stored = BaseModelOutputWithDeepstackFeatures(pooler_output=(record.image_embeds,),
                                                          deepstack_features=[(layer,) for layer in layers])
            ids, positions = record.input_ids[None], record.position_ids[:, None]
            ours = model(input_ids=ids, position_ids=positions, mm_encoder_outputs={"image": stored}).logits
            images = [decode_image(blob, DecodeConfig()).pixels for blob in rows[record.id]["images"]]
            pixel_values, grid_thw = family.reference_preprocess(images)
            types = (record.token_tags == IMAGE).long()[None]
            expected = model(input_ids=ids, pixel_values=pixel_values, image_grid_thw=grid_thw,
                             mm_token_type_ids=types).logits
            assert (ours - expected).abs().max() <= 1e-4 * expected.abs().max() + 1e-5, record.id
            checked += 1
    assert checked >= 4
