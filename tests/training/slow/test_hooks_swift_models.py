"""stored_post_encode against the Qwen2/2.5-VL models themselves: the embeddings at the image and video tokens, a
training step's loss through ms-swift's hook, the stored positions against get_rope_index."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
from conftest import embed_in_process
from hf_models import never_called, pretrained
from transformers.modeling_outputs import BaseModelOutputWithPooling

from batchvlm.families import ModelConfig, load_family, tiny_checkpoint
from batchvlm.training import load_run_dataset, pack
from batchvlm.training.hooks import stored_post_encode
from batchvlm.training.model_inputs import forward_parameters, model_inputs, pad
from batchvlm.training.reader import read_run
from batchvlm.training.trainer import RowCollator
from test_model_inputs import pixel_loss  # the record's loss with the model fed its pixels
from test_qwen2_vl import _tiny_variant, qwen2_5_config  # the Qwen2.5-VL checkpoint those tests build
from test_training_equivalence import qwen3_checkpoint  # Qwen3-VL's, with deepstack layers

# the job's runs and full models
pytestmark = pytest.mark.slow


MAX_TOKENS = 4096


# ms-swift @3602360a, swift/template/base.py:1648-1664, `Template.pre_forward_hook(model, args, kwargs)`: it calls
# `self._post_encode(model, old_kwargs)` (the collator's batch), then puts back these keys of the batch where the
# returned dict lacks them (lines 1652-1654), drops `input_ids` when `inputs_embeds` was returned (1657-1658) and
# `position_ids` when `forward` does not name it (1660-1663), and forwards that dict; every other key of the batch is
# dropped.
SWIFT_KEPT_KEYS = {"input_ids", "attention_mask", "labels", "position_ids", "output_hidden_states", "logits_to_keep",
                   "max_length_q", "max_length_k", "cu_seq_lens_q", "cu_seq_lens_k", "mm_token_type_ids"}


def swift_forward_kwargs(model, batch_inputs: dict) -> dict:
    """What ms-swift's pre_forward_hook hands the model's forward for a batch, the template's _post_encode being
    stored_post_encode."""
    kwargs = stored_post_encode(model, batch_inputs)
    for key, value in batch_inputs.items():
        if key in SWIFT_KEPT_KEYS and key not in kwargs:
            kwargs[key] = value
    if "inputs_embeds" in kwargs:
        kwargs.pop("input_ids", None)
    if "position_ids" not in inspect.signature(model.forward).parameters:
        kwargs.pop("position_ids", None)
    return kwargs


def qwen2_5_checkpoint(folder: Path) -> Path:
    qwen = load_family(ModelConfig(family="qwen2_vl"))
    _tiny_variant(folder, qwen, qwen2_5_config(qwen))
    return folder


CHECKPOINTS = {"qwen2_vl": lambda _: tiny_checkpoint("qwen2_vl"), "qwen2_5_vl": qwen2_5_checkpoint,
               "qwen3_vl": qwen3_checkpoint}


EMBEDS_KEYS = {"inputs_embeds", "position_ids", "labels", "use_cache"}
"""What the forward gets through ms-swift's hook: Qwen2/2.5-VL's stored rows in inputs_embeds, ..."""

DEEPSTACK_KEYS = {"input_ids", "mm_encoder_outputs", "position_ids", "labels", "use_cache"}
"""... Qwen3-VL's as mm_encoder_outputs, whose deepstack layers go in at the image tokens of input_ids."""


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def stored(request, tmp_path_factory):
    """The job's fp32 run of 8 demo records through a Qwen2/2.5-VL checkpoint (the reference preprocessing: the tower
    saw the processor's own pixels), the model, its family, and records with images then one without."""
    root = tmp_path_factory.mktemp(request.param)
    checkpoint = CHECKPOINTS[request.param](root / "checkpoint")
    run = embed_in_process(root, "train", "model.family=qwen2_vl", f"model.path={checkpoint}",
                           "output.embed_dtype=float32", "dataset.limit=8", "preprocess.backend=reference")
    family = load_family(ModelConfig(family="qwen2_vl", path=str(checkpoint)))
    model = pretrained(checkpoint, dtype=torch.float32)
    records = list(read_run(run))
    chosen = [r for r in records if len(r.grid_thw)][:2] + [r for r in records if not len(r.grid_thw)][:1]
    return request.param, model, family, chosen, run


@pytest.fixture
def sentinel(stored):
    """The tower's forward raises: a call of it fails the test."""
    with never_called(stored[1].model.visual):
        yield


def pixel_embeds(model, family, record) -> torch.Tensor:
    """The model's own image features of the record's pixels (its HF image processor's), scattered by its own
    placeholder mask into the embeddings of the record's input_ids: what ms-swift's Qwen2VLTemplate builds."""
    from batchvlm.demo import demo_rows
    from batchvlm.pipeline.decode import DecodeConfig, decode_image

    blobs = {row["id"]: row for row in demo_rows()}[record.id]["images"]
    pixel_values, grid_thw = family.reference_preprocess([decode_image(b, DecodeConfig()).pixels for b in blobs])
    input_ids = record.input_ids[None]
    embeds = model.get_input_embeddings()(input_ids)
    features = torch.cat(model.model.get_image_features(pixel_values, grid_thw).pooler_output)
    at, _ = model.model.get_placeholder_mask(input_ids, inputs_embeds=embeds, image_features=features)
    return embeds.masked_scatter(at, features)


def test_the_embeddings_are_the_models_own_image_features_of_the_pixels_at_its_image_tokens(stored, request):
    name, model, family, chosen, _ = stored
    if name == "qwen3_vl":
        pytest.skip("Qwen3-VL gets mm_encoder_outputs, no inputs_embeds (its loss is the next test's)")
    with torch.no_grad():
        expected = [pixel_embeds(model, family, record) for record in chosen[:2]]
        request.getfixturevalue("sentinel")  # from here on the tower raises
        for record, pixels in zip(chosen, expected):
            got = stored_post_encode(model, model_inputs(model, pack([record], MAX_TOKENS)))["inputs_embeds"]
            assert got.shape == pixels.shape
            assert (got - pixels).abs().max() <= 1e-5 * pixels.abs().max(), (name, record.id)


def test_one_step_through_swifts_hook_gives_the_pixel_loss_and_trains_no_tower_parameter(stored, request):
    name, model, family, chosen, _ = stored
    with torch.no_grad():  # the pixel path, before the sentinel
        per_record = [pixel_loss(model, family, record, pack([record], MAX_TOKENS).labels) for record in chosen]
    pixels = sum(loss * tokens for loss, tokens in per_record) / sum(tokens for _, tokens in per_record)
    request.getfixturevalue("sentinel")
    batch = pack(chosen, MAX_TOKENS)
    kwargs = swift_forward_kwargs(model, model_inputs(model, batch))
    assert set(kwargs) == (DEEPSTACK_KEYS if name == "qwen3_vl" else EMBEDS_KEYS) <= forward_parameters(model)
    assert kwargs["position_ids"] is batch.position_ids and kwargs["use_cache"] is False
    model.zero_grad()
    loss = model(**kwargs).loss
    loss.backward()
    print(f"{name}: loss {float(loss.detach()):.7f}, pixel path {float(pixels):.7f}")
    assert abs(float(loss.detach()) - float(pixels)) <= 1e-5 * float(pixels), name
    assert model.get_input_embeddings().weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in model.model.visual.parameters()), name
    model.zero_grad()
    with torch.no_grad():  # why use_cache is returned: the hook drops it, and a cache lets packed records mix
        cached = model(**{key: value for key, value in kwargs.items() if key != "use_cache"}).loss
    assert abs(float(cached) - float(pixels)) > 1e-4 * float(pixels), name


def test_rows_through_the_row_collator_give_the_packed_batchs_loss(stored, sentinel, tmp_path):
    """RowCollator over the run's `datasets` rows (a padded batch with an attention mask, which ms-swift's hook
    keeps), as the documented template's _data_collator gives them."""
    name, model, _, chosen, run = stored
    dataset = load_run_dataset(run, cache_dir=str(tmp_path / "cache"))
    at = {record_id: index for index, record_id in enumerate(dataset["id"])}
    rows = [dataset[at[record.id]] for record in chosen]
    kwargs = swift_forward_kwargs(model, RowCollator(model, dataset, MAX_TOKENS)(rows))
    assert "attention_mask" in kwargs and kwargs["attention_mask"].shape[0] == len(chosen) > 1
    assert torch.equal(kwargs["position_ids"], pad(chosen, MAX_TOKENS).position_ids)
    with torch.no_grad():
        packed = model(**swift_forward_kwargs(model, model_inputs(model, pack(chosen, MAX_TOKENS)))).loss
        assert torch.allclose(model(**kwargs).loss, packed, rtol=1e-5), name


def test_the_stored_positions_are_those_swifts_collator_computes_with_get_rope_index(stored):
    """ms-swift's Qwen2VLTemplate._data_collator runs the model's get_rope_index over the batch's image grids and
    puts a text row first (_concat_text_position_ids); the stored positions are that, for the stored grids."""
    name, model, _, chosen, _ = stored
    padded = pad(chosen, MAX_TOKENS)
    types = (padded.input_ids == model.config.image_token_id).long()  # ms-swift's mm_token_type_ids: 1 on images
    rope, _ = model.model.get_rope_index(padded.input_ids, types, image_grid_thw=padded.grid_thw,
                                         attention_mask=padded.attention_mask)
    kept = padded.attention_mask.bool()
    assert torch.equal(padded.position_ids[1:][:, kept], rope[:, kept]), name
    text = torch.arange(padded.input_ids.shape[1]).expand_as(padded.input_ids)
    assert torch.equal(padded.position_ids[0][kept], text[kept]), name


def test_a_batch_that_cannot_be_stored_features_is_refused(stored):
    name, model, _, chosen, _ = stored
    inputs = model_inputs(model, pack(chosen[:1], MAX_TOKENS))
    with pytest.raises(ValueError, match="pixel_values"):
        stored_post_encode(model, {**inputs, "pixel_values": torch.zeros(4, 1176)})
    with pytest.raises(ValueError, match="no position_ids"):
        stored_post_encode(model, {k: v for k, v in inputs.items() if k != "position_ids"})
    if name == "qwen3_vl":
        return  # its rows are counted against its image tokens by the model's forward
    fewer = BaseModelOutputWithPooling(pooler_output=(inputs["mm_encoder_outputs"]["image"].pooler_output[0][1:],))
    with pytest.raises(ValueError, match="image tokens but its stored image rows are"):
        stored_post_encode(model, {**inputs, "mm_encoder_outputs": {"image": fewer}})


def test_clips_go_in_at_the_video_tokens_as_the_models_own_scatter_puts_them(clip_run):
    """A clip run (a clip alone, a clip and an image, two clips): the loss through ms-swift's hook is the model's own
    with the same rows as mm_encoder_outputs (its placeholder mask and scatter), and another without the clip rows."""
    model = pretrained(tiny_checkpoint("qwen2_vl"), dtype=torch.float32)
    records = [record for record in read_run(clip_run) if record.video_embeds is not None]
    batch = pack(records, MAX_TOKENS)
    inputs = model_inputs(model, batch)
    assert set(inputs["mm_encoder_outputs"]) == {"image", "video"}

    with never_called(model.model.visual), torch.no_grad():
        ours = model(**swift_forward_kwargs(model, inputs)).loss
        own = model(**inputs).loss
        video = inputs["mm_encoder_outputs"]["video"]
        zeroed = BaseModelOutputWithPooling(pooler_output=tuple(torch.zeros_like(rows) for rows in video.pooler_output))
        without = model(**swift_forward_kwargs(model, {**inputs, "mm_encoder_outputs": {
            "image": inputs["mm_encoder_outputs"]["image"], "video": zeroed}})).loss
    assert torch.allclose(ours, own, rtol=1e-6) and not torch.allclose(ours, without, rtol=1e-3)
