"""stored_image_features: the model's get_image_features replaced for a stack that passes pixels. Oracles: a sentinel
in the tower's forward proves it never runs; the logits are those of the model fed the pixels; rows stored before
the projector train the projector and no tower parameter."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from conftest import summary_in_process
from hf_models import LFM2_IMAGE_TOKEN, lfm2_vl_over, never_called, pretrained

from batchvlm.demo import demo_rows
from batchvlm.families import ModelConfig, load_family, tiny_checkpoint
from batchvlm.families.common import processor_inputs
from batchvlm.format.schema import IMAGE
from batchvlm.pipeline.decode import DecodeConfig, decode_image
from batchvlm.training import pack
from batchvlm.training.hooks import projector, stored_image_features, vision_tower
from batchvlm.training.reader import read_run

# the job per family, then the full models
pytestmark = pytest.mark.slow

MAX_TOKENS = 4096


@pytest.fixture(scope="module", params=["qwen2_vl", "kimi_k25"])
def both(request, tmp_path_factory):
    """A run that stored the projector's output (image_embeds) and its input (tower_embeds), fp32, from the processor's
    own pixels; the model; records with images, the pixel inputs its processor gives them and their logits."""
    name = request.param
    root = tmp_path_factory.mktemp(name)
    summary = summary_in_process(root, "train", f"model.family={name}", "model.embedding=both",
                                 "output.embed_dtype=float32", "preprocess.backend=reference", "dataset.limit=6")
    assert summary is not None and summary["complete"]
    family = load_family(ModelConfig(family=name))
    model = pretrained(tiny_checkpoint(name), dtype=torch.float32)
    rows = {row["id"]: row for row in demo_rows()}
    cases = []
    for record in read_run(root / "train"):
        if len(record.grid_thw):
            pixel_values, grid_thw = family.reference_preprocess(
                [decode_image(blob, DecodeConfig()).pixels for blob in rows[record.id]["images"]])
            inputs = {"input_ids": record.input_ids[None], "pixel_values": pixel_values, "image_grid_thw": grid_thw,
                      **_token_types(model, record)}
            with torch.no_grad():
                cases.append((record, inputs, model(**inputs).logits))  # the tower runs on the processor's pixels
    return name, model, cases[:2]


def _token_types(model, record) -> dict:
    if "mm_token_type_ids" in inspect.signature(model.forward).parameters:
        return {"mm_token_type_ids": (record.token_tags == IMAGE).long()[None]}
    return {}


def tower_parameters(model) -> dict[str, torch.nn.Parameter]:
    """The vision parameters that are not the projector's."""
    projector_ids = {id(p) for p in projector(model).parameters()}
    return {name: p for name, p in vision_tower(model).named_parameters() if id(p) not in projector_ids}


@pytest.fixture
def sentinel(both):
    """The tower's forward raises: a call of it fails the test."""
    with never_called(vision_tower(both[1])):
        yield


@pytest.mark.parametrize("column", ["image_embeds", "tower_embeds"])
def test_the_stack_passing_pixels_gets_the_pixel_logits_from_stored_rows_without_the_tower(both, sentinel, column):
    name, model, cases = both
    with torch.no_grad():
        for record, inputs, pixels in cases:
            with stored_image_features(model, pack([record], MAX_TOKENS), column):
                got = model(**inputs).logits
            assert (got - pixels).abs().max() <= 1e-4 * pixels.abs().max(), (name, column, record.id)
            with pytest.raises(AssertionError, match="the vision tower ran"):  # the hook is gone after the block
                model(**inputs)


def test_rows_stored_before_the_projector_train_the_projector_and_no_tower_parameter(both, sentinel):
    name, model, cases = both
    record, inputs, _ = cases[0]
    model.zero_grad()
    batch = pack([record], MAX_TOKENS)
    with stored_image_features(model, batch, "tower_embeds"):
        model(**inputs, labels=batch.labels).loss.backward()
    grads = {n: p.grad for n, p in projector(model).named_parameters()}
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads.values()), name
    assert all(p.grad is None for p in tower_parameters(model).values()), name
    model.zero_grad()


def test_without_pre_projector_rows_the_hook_is_refused(both):
    _, model, cases = both
    batch = pack([cases[0][0]], MAX_TOKENS)
    batch.extras.pop("tower_embeds")
    with pytest.raises(ValueError, match="model.embedding=both"):
        with stored_image_features(model, batch, "tower_embeds"):
            pass


# LFM2-VL: a SigLIP2 run's patch tokens (stored before any projector) through the model's pixel-unshuffle projector.

@pytest.fixture(scope="module")
def lfm2(tmp_path_factory):
    """A SigLIP2 run (fp32, the processor's own pixels), an LFM2-VL model over the same tower, and the records with
    one image each, by name: their packed batch, the inputs a stack gives LFM2-VL for them (the SigLIP2 processor's
    padded pixels, spatial_shapes and mask; a prompt with (h/2)*(w/2) image tokens) and the pixel path's logits."""
    root = tmp_path_factory.mktemp("lfm2_vl")
    summary = summary_in_process(root, "train", "model=siglip2_tiny", "output.embed_dtype=float32",
                                 "preprocess.backend=reference", "dataset.limit=8")
    assert summary is not None and summary["complete"]
    family = load_family(ModelConfig(family="siglip2"))
    model = lfm2_vl_over(tiny_checkpoint("siglip2"), root / "lfm2_vl")
    rows = {row["id"]: row for row in demo_rows()}
    cases = {}
    for record in read_run(root / "train"):
        if len(record.grid_thw) != 1:
            continue
        image = decode_image(rows[record.id]["images"][0], DecodeConfig()).pixels
        pixels = family.reference_processor()(images=processor_inputs([image]), return_tensors="pt")
        _, height, width = record.grid_thw[0].tolist()
        prompt = [1, 17, 23] + [LFM2_IMAGE_TOKEN] * ((height // 2) * (width // 2)) + [31, 41, 59, 2]
        inputs = {"input_ids": torch.tensor([prompt]), **pixels}
        logits = None
        if height % 2 == 0 and width % 2 == 0:
            with torch.no_grad():
                logits = model(**inputs).logits  # the tower runs on the processor's pixels
        cases[record.id] = (pack([record], MAX_TOKENS), inputs, logits)
    return model, cases


def even(cases) -> list:
    """The cases whose grids the projector's 2x2 blocks tile."""
    found = [case for case in cases.values() if case[2] is not None]
    assert len(found) >= 2
    return found


@pytest.fixture
def lfm2_sentinel(lfm2):
    with never_called(vision_tower(lfm2[0])):
        yield


def test_siglip2_patch_tokens_through_lfm2_vl_projector_give_the_pixel_logits_without_the_tower(lfm2, lfm2_sentinel):
    model, cases = lfm2
    with torch.no_grad():
        for batch, inputs, pixels in even(cases):
            with stored_image_features(model, batch):
                got = model(**inputs).logits
            assert (got - pixels).abs().max() <= 1e-4 * pixels.abs().max(), batch.ids
            with pytest.raises(AssertionError, match="the vision tower ran"):
                model(**inputs)


def test_siglip2_patch_tokens_train_lfm2_vl_projector_and_no_tower_parameter(lfm2, lfm2_sentinel):
    model, cases = lfm2
    batch, inputs, _ = even(cases)[0]
    labels = inputs["input_ids"].masked_fill(inputs["input_ids"] == LFM2_IMAGE_TOKEN, -100)
    model.zero_grad()
    with stored_image_features(model, batch):
        model(**inputs, labels=labels).loss.backward()
    grads = dict(projector(model).named_parameters())
    assert grads and all(p.grad is not None and p.grad.abs().sum() > 0 for p in grads.values())
    assert all(p.grad is None for p in tower_parameters(model).values())
    model.zero_grad()


def test_a_grid_the_projector_blocks_do_not_tile_is_refused_naming_the_record(lfm2):
    model, cases = lfm2
    odd = [case for case in cases.values() if case[2] is None]
    assert odd
    batch = odd[0][0]
    with pytest.raises(ValueError, match=f"{batch.ids[0]}.*multiples of downsample_factor=2"):
        with stored_image_features(model, batch):
            pass


def test_rows_of_another_tower_width_are_refused(lfm2):
    model, cases = lfm2
    batch = even(cases)[0][0]
    wider = dataclasses.replace(batch, image_embeds=torch.cat([batch.image_embeds] * 2, dim=1))
    with pytest.raises(ValueError, match="64 wide but .* gives 32"):
        with stored_image_features(model, wider):
            pass


def test_a_stack_whose_images_have_other_grids_than_the_stored_rows_is_refused(lfm2):
    model, cases = lfm2
    first, *rest = even(cases)
    other = next(case for case in rest if not torch.equal(case[0].grid_thw, first[0].grid_thw))
    with pytest.raises(ValueError, match="counted for other images"), torch.no_grad():
        with stored_image_features(model, first[0]):
            model(**other[1])


def test_a_siglip2_run_has_no_pre_projector_column_to_name(lfm2):
    model, cases = lfm2
    with pytest.raises(ValueError, match="already the tower's patch tokens"):
        with stored_image_features(model, even(cases)[0][0], "tower_embeds"):
            pass
