"""model_inputs: a batch of stored features as the model's own forward arguments. Oracles: the model fed the pixels
through its own image processor's outputs gives the same loss, and so does the manual loop of docs/training.md;
a padded batch gives each record the logits and the loss the packed batch gives it."""

from __future__ import annotations

import inspect

import pytest
import torch
from hf_models import pretrained
from test_training_equivalence import CHECKPOINTS, FAMILY_OF, trained_run
from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

from batchvlm.demo import demo_rows
from batchvlm.families import ModelConfig, load_family
from batchvlm.format.schema import IMAGE
from batchvlm.pipeline.decode import DecodeConfig, decode_image
from batchvlm.training import PackedBatch, pack
from batchvlm.training.model_inputs import forward_parameters, model_inputs, pad
from batchvlm.training.reader import read_run

# the job per family, then the full models
pytestmark = pytest.mark.slow

MAX_TOKENS = 4096


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def stored(request, tmp_path_factory):
    """A family's run (fp32, the reference preprocessing: the tower saw the processor's own pixels), its model and
    its family, as the pixel path needs them."""
    checkpoint, run = trained_run(request.param, tmp_path_factory.mktemp(request.param), "preprocess.backend=reference")
    name = FAMILY_OF.get(request.param, request.param)
    family = load_family(ModelConfig(family=name, path=str(checkpoint)))
    model = pretrained(checkpoint, dtype=torch.float32)
    records = list(read_run(run))
    chosen = [r for r in records if len(r.grid_thw)][:3] + [r for r in records if not len(r.grid_thw)][:1]
    return request.param, model, family, chosen


def pixel_loss(model, family, record, labels) -> tuple[torch.Tensor, int]:
    """The record's loss with the model fed its pixels (the family's HF image processor), and its trained tokens."""
    blobs = {row["id"]: row for row in demo_rows()}[record.id]["images"]
    images = [decode_image(blob, DecodeConfig()).pixels for blob in blobs]
    extra = {}
    if images:
        extra["pixel_values"], extra["image_grid_thw"] = family.reference_preprocess(images)
    if "mm_token_type_ids" in inspect.signature(model.forward).parameters:
        extra["mm_token_type_ids"] = (record.token_tags == IMAGE).long()[None]
    loss = model(input_ids=record.input_ids[None], labels=labels, use_cache=False, **extra).loss
    return loss, int((labels[:, 1:] != -100).sum())


def manual_loss(model, batch: PackedBatch) -> torch.Tensor:
    """The loop docs/training.md shows as the low-level path."""
    if batch.deepstack_embeds is not None:
        stored = BaseModelOutputWithDeepstackFeatures(pooler_output=(batch.image_embeds,),
                                                      deepstack_features=[(layer,) for layer in batch.deepstack_embeds])
        return model(input_ids=batch.input_ids, position_ids=batch.position_ids, labels=batch.labels,
                     use_cache=False, mm_encoder_outputs={"image": stored}).loss
    embeds = model.get_input_embeddings()(batch.input_ids)
    embeds = embeds.index_put((torch.zeros_like(batch.image_positions), batch.image_positions),
                              batch.image_embeds.to(embeds.dtype))
    return model(inputs_embeds=embeds, position_ids=batch.position_ids, labels=batch.labels, use_cache=False).loss


def test_the_inputs_are_forward_parameters_and_never_pixels(stored):
    name, model, _, chosen = stored
    inputs = model_inputs(model, pack(chosen, MAX_TOKENS))
    assert set(inputs) <= forward_parameters(model)
    assert not {"pixel_values", "image_grid_thw", "inputs_embeds"} & set(inputs)
    assert {"input_ids", "labels", "position_ids", "mm_encoder_outputs"} <= set(inputs)
    has_deepstack = hasattr(inputs["mm_encoder_outputs"]["image"], "deepstack_features")
    assert has_deepstack == (name == "qwen3_vl")


def test_one_steps_loss_is_the_pixel_paths_and_the_manual_loops(stored):
    name, model, family, chosen = stored
    batch = pack(chosen, MAX_TOKENS)
    with torch.no_grad():
        ours = model(**model_inputs(model, batch)).loss
        manual = manual_loss(model, batch)
        per_record = [pixel_loss(model, family, record, pack([record], MAX_TOKENS).labels) for record in chosen]
        alone = [model(**model_inputs(model, pack([record], MAX_TOKENS))).loss for record in chosen]
    # The packed loss is the mean over every record's trained tokens: the pixel losses weighted by their tokens.
    pixels = sum(loss * tokens for loss, tokens in per_record) / sum(tokens for _, tokens in per_record)
    differences = {"manual": float((ours - manual).abs()), "pixels": float((ours - pixels).abs()),
                   "alone": max(float((a - p).abs()) for a, (p, _) in zip(alone, per_record))}
    print(f"{name}: loss {float(ours):.6f}, |difference| {differences}")
    assert max(differences.values()) <= 1e-5 * float(pixels), (name, differences)


def test_a_padded_batch_gives_each_record_the_packed_batchs_logits_and_loss(stored):
    name, model, _, chosen = stored
    packed, padded = pack(chosen, MAX_TOKENS), pad(chosen, MAX_TOKENS)
    assert padded.input_ids.shape[0] == len(chosen) > 1 and not padded.attention_mask.all()
    with torch.no_grad():
        packed_out = model(**model_inputs(model, packed))
        padded_out = model(**model_inputs(model, padded))
    bounds = packed.cu_seqlens.tolist()
    for row, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:])):
        expected = packed_out.logits[0, start:stop]
        got = padded_out.logits[row, :stop - start]
        assert (got - expected).abs().max() <= 1e-4 * expected.abs().max(), (name, chosen[row].id)
    assert torch.allclose(padded_out.loss, packed_out.loss, rtol=1e-5), name


def test_a_forward_without_encoder_outputs_gets_the_rows_in_inputs_embeds_with_the_stored_positions(stored):
    """transformers before mm_encoder_outputs (a forward without the argument): the same loss from inputs_embeds."""
    name, model, _, chosen = stored
    if name == "qwen3_vl":
        with pytest.raises(ValueError, match="deepstack"):
            model_inputs(_without_encoder_outputs(model), pack(chosen, MAX_TOKENS))
        return
    older = _without_encoder_outputs(model)
    for batch in (pack(chosen, MAX_TOKENS), pad(chosen, MAX_TOKENS)):
        inputs = model_inputs(older, batch)
        assert "inputs_embeds" in inputs and "input_ids" not in inputs and "mm_encoder_outputs" not in inputs
        with torch.no_grad():
            assert torch.allclose(older(**inputs).loss, model(**model_inputs(model, batch)).loss, rtol=1e-5), name


def _without_encoder_outputs(model):
    """The same model and weights behind a forward whose signature lacks mm_encoder_outputs (as before transformers
    5 had it)."""
    def forward(input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, labels=None,
                use_cache=None, pixel_values=None, image_grid_thw=None):
        return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                     inputs_embeds=inputs_embeds, labels=labels, use_cache=use_cache, pixel_values=pixel_values,
                     image_grid_thw=image_grid_thw)

    class Older(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def get_input_embeddings(self):
            return model.get_input_embeddings()

    older = Older()
    older.forward = forward
    return older
