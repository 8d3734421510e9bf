"""stored_encode_images: LLaVA's (haotian-liu/LLaVA) `encode_images` replaced, so that its training loop takes stored
tower features through its own projector. The original codebase does not install here (it pins its own torch and
transformers); the stand-in is transformers' `llava` model, whose `get_image_features` is LLaVA's `encode_images`
(the tower's selected layer without CLS, then the two-layer GELU projector) and whose forward scatters what it gets
into the image tokens as `prepare_inputs_labels_for_multimodal` does for pre-expanded ids. Oracles: the pixel path's
logits, a sentinel in the tower, the projector's gradients."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hf_models import never_called, nontrivial_biases_and_norms

from batchvlm.demo import demo_rows
from batchvlm.families.common import processor_inputs
from batchvlm.format.schema import IMAGE, TEXT
from batchvlm.pipeline.decode import DecodeConfig, decode_image
from batchvlm.training import pack
from batchvlm.training.hooks import stored_encode_images
from batchvlm.training.reader import RecordTensors

pytestmark = pytest.mark.slow  # builds and saves a model

IMAGE_TOKEN = 300
SELECT_LAYER = -2  # LLaVA-1.5's mm_vision_select_layer


class OriginalLlava:
    """LLaVA's model interface over transformers' llava: `get_model().get_vision_tower()`, `.mm_projector`,
    `encode_images(images)` -> [N, P, D], and a forward that takes what `encode_images` returns."""

    def __init__(self, hf_model):
        self.hf = hf_model

    def get_model(self):
        inner = self.hf.model
        return dataclasses.make_dataclass("Meta", ["vision_tower", "mm_projector"])(
            inner.vision_tower, inner.multi_modal_projector)

    def encode_images(self, images):
        return torch.stack(self.hf.get_image_features(pixel_values=images, vision_feature_layer=SELECT_LAYER,
                                                      vision_feature_select_strategy="default").pooler_output)

    def forward(self, input_ids, images, labels=None):
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        features = self.encode_images(images)
        return self.hf(input_ids=input_ids, labels=labels,
                       mm_encoder_outputs={"image": BaseModelOutputWithPooling(pooler_output=tuple(features))})


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    """A tiny transformers llava (CLIP tower at 32 px, 4x4 patches; Llama), saved and loaded back; two demo images
    through the CLIP processor; a prompt with both; what a run of its tower stores for them (the selected layer's
    patch features, CLS dropped) as a packed batch of one record."""
    from transformers import (CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration)

    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                              image_size=32, patch_size=8)
    text = LlamaConfig(vocab_size=320, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_id=IMAGE_TOKEN,
                         vision_feature_layer=SELECT_LAYER, vision_feature_select_strategy="default")
    torch.manual_seed(30)
    folder = tmp_path_factory.mktemp("llava")
    built = LlavaForConditionalGeneration(config)
    nontrivial_biases_and_norms(built)
    built.save_pretrained(folder)
    model = LlavaForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    images = [decode_image(row["images"][0], DecodeConfig()).pixels for row in demo_rows()[:2]]
    pixels = processor(images=processor_inputs(images), return_tensors="pt")["pixel_values"]
    patches = (32 // 8) ** 2
    ids = [1, 17] + [IMAGE_TOKEN] * patches + [23, 29] + [IMAGE_TOKEN] * patches + [31, 2]
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        stored = model.model.vision_tower(pixels, output_hidden_states=True).hidden_states[SELECT_LAYER][:, 1:]
        logits = model(input_ids=input_ids, pixel_values=pixels).logits  # the pixel path
    tags = torch.tensor([IMAGE if token == IMAGE_TOKEN else TEXT for token in ids], dtype=torch.int8)
    record = RecordTensors(id="two-images", input_ids=input_ids[0], image_embeds=stored.flatten(0, 1).contiguous(),
                           grid_thw=torch.tensor([[1, 4, 4], [1, 4, 4]]),
                           image_spans=torch.tensor([[2, patches], [4 + patches, patches]]), token_tags=tags,
                           extras={}, position_ids=None, rope_delta=None)
    return model, pixels, input_ids, pack([record], 4096), logits


@pytest.fixture
def sentinel(llava):
    with never_called(llava[0].model.vision_tower):
        yield


def test_the_stand_in_keeps_llava_encode_images_contract(llava):
    model, pixels, input_ids, _, logits = llava
    original = OriginalLlava(model)
    with torch.no_grad():
        assert original.encode_images(pixels).shape == (2, 16, 48)  # [images, patches, LM hidden]
        assert torch.equal(original.forward(input_ids, pixels).logits, logits)


def test_stored_tower_features_give_llava_the_pixel_logits_without_its_tower(llava, sentinel):
    model, pixels, input_ids, batch, logits = llava
    original = OriginalLlava(model)
    with torch.no_grad():
        with stored_encode_images(original, batch):
            got = original.forward(input_ids, pixels).logits
        assert (got - logits).abs().max() <= 1e-5 * logits.abs().max()
        with pytest.raises(AssertionError, match="the vision tower ran"):  # the shim is gone after the block
            original.forward(input_ids, pixels)


def test_stored_tower_features_train_llava_projector_and_no_tower_parameter(llava, sentinel):
    model, pixels, input_ids, batch, _ = llava
    original = OriginalLlava(model)
    model.zero_grad()
    labels = input_ids.masked_fill(input_ids == IMAGE_TOKEN, -100)
    with stored_encode_images(original, batch):
        original.forward(input_ids, pixels, labels=labels).loss.backward()
    projector = list(model.model.multi_modal_projector.parameters())
    assert projector and all(p.grad is not None and p.grad.abs().sum() > 0 for p in projector)
    assert all(p.grad is None for p in model.model.vision_tower.parameters())
    model.zero_grad()


def test_images_of_different_grids_are_refused(llava):
    model, _, _, batch, _ = llava
    mixed = dataclasses.replace(batch, grid_thw=torch.tensor([[1, 4, 4], [1, 2, 8]]))
    with pytest.raises(ValueError, match="same patch grid"):
        with stored_encode_images(OriginalLlava(model), mixed):
            pass


def test_rows_of_another_width_are_refused(llava):
    model, _, _, batch, _ = llava
    wider = dataclasses.replace(batch, image_embeds=torch.cat([batch.image_embeds] * 2, dim=1))
    with pytest.raises(ValueError, match="64 wide but the model's mm_projector takes 32"):
        with stored_encode_images(OriginalLlava(model), wider):
            pass


def test_a_column_the_run_did_not_store_is_refused(llava):
    model, _, _, batch, _ = llava
    with pytest.raises(ValueError, match="no tower_embeds"):
        with stored_encode_images(OriginalLlava(model), batch, "tower_embeds"):
            pass
