"""stored_image_features: the model's get_image_features replaced for a stack that passes pixels. Oracles: a sentinel
in the tower's forward proves it never runs; the logits are those of the model fed the pixels; rows stored before
the projector train the projector and no tower parameter."""

from __future__ import annotations

import inspect

import pytest
import torch
from conftest import summary_in_process
from hf_models import pretrained

from batchvlm.demo import demo_rows
from batchvlm.families import ModelConfig, load_family, tiny_checkpoint
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
    _, model, _ = both
    module = vision_tower(model)

    def never(*_, **__):
        raise AssertionError("the vision tower ran")

    module.forward = never
    yield
    del module.forward


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
