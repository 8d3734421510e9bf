"""Strict loading (families/checkpoint.py), the same for every family: a checkpoint missing a vision tensor, holding
one its config.json has no place for, or one of another shape is refused by name and file before any tensor is read;
the released and transformers layouts give the same embeddings; only the vision tensors are read; the tiny
checkpoints are released-looking, with no tensor left at a constant."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import all_families
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from batchvlm.families import ModelConfig
from batchvlm.families import family_module, load_family, tiny_checkpoint
from batchvlm.families.checkpoint import CheckpointError, load_weights
from batchvlm.families.common import read_config

TENSOR_CLASSES = {
    "kimi_k25": {"patch embed": "vision_tower.patch_embed.proj.weight",
                 "qkv": "vision_tower.encoder.blocks.0.wqkv.weight",
                 "qkv bias": "vision_tower.encoder.blocks.1.wqkv.bias",
                 "norm weight": "vision_tower.encoder.blocks.0.norm0.weight",
                 "norm bias": "vision_tower.encoder.blocks.1.norm1.bias",
                 "position table": "vision_tower.patch_embed.pos_emb.weight",
                 "projector": "mm_projector.proj.0.weight",
                 "projector norm": "mm_projector.pre_norm.weight"},
    "qwen2_vl": {"patch embed": "visual.patch_embed.proj.weight",
                 "qkv": "visual.blocks.0.attn.qkv.weight",
                 "qkv bias": "visual.blocks.1.attn.qkv.bias",
                 "norm weight": "visual.blocks.0.norm1.weight",
                 "norm bias": "visual.blocks.1.norm2.bias",
                 "projector": "visual.merger.mlp.0.weight",
                 "projector norm": "visual.merger.ln_q.bias"},
    "qwen2_5_vl_7b": {"patch embed": "visual.patch_embed.proj.weight",
                      "qkv": "visual.blocks.1.attn.qkv.weight",
                      "qkv bias": "visual.blocks.0.attn.qkv.bias",
                      "norm weight": "visual.blocks.1.norm2.weight",  # RMSNorm: no norm bias
                      "projector": "visual.merger.mlp.2.weight",
                      "projector norm": "visual.merger.ln_q.weight"},
    "qwen3_vl_8b": {"patch embed": "model.visual.patch_embed.proj.bias",
                    "qkv": "model.visual.blocks.2.attn.qkv.weight",
                    "qkv bias": "model.visual.blocks.0.attn.qkv.bias",
                    "norm weight": "model.visual.blocks.0.norm1.weight",
                    "norm bias": "model.visual.blocks.1.norm2.bias",
                    "position table": "model.visual.pos_embed.weight",
                    "projector": "model.visual.merger.linear_fc1.weight",
                    "deepstack projector": "model.visual.deepstack_merger_list.1.norm.bias"},
    "siglip2": {"patch embed": "vision_model.embeddings.patch_embedding.weight",
                "qkv": "vision_model.encoder.layers.0.self_attn.q_proj.weight",
                "qkv bias": "vision_model.encoder.layers.1.self_attn.k_proj.bias",
                "norm weight": "vision_model.encoder.layers.0.layer_norm1.weight",
                "norm bias": "vision_model.post_layernorm.bias",
                "position table": "vision_model.embeddings.position_embedding.weight",
                "pooling head": "vision_model.head.attention.in_proj_weight",
                "pooling probe": "vision_model.head.probe"},
}
"""One stored name of each class of vision tensor, per checkpoint: the tiny demo ones (kimi_k25, qwen2_vl, siglip2)
and tiny copies of the released Qwen2.5-VL and Qwen3-VL configs (no position table in Qwen2/2.5-VL: rotary only)."""
CASES = [(kind, tensor_class) for kind, classes in TENSOR_CLASSES.items() for tensor_class in classes]
RELEASE_COPIES = {"qwen2_5_vl_7b", "qwen3_vl_8b"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The checkpoint folder of each kind (copies of released configs built once, without a tokenizer of their own
    ids: the check below needs none)."""
    def folder(kind: str) -> Path:
        if kind not in RELEASE_COPIES:
            return tiny_checkpoint(kind)
        target = tmp_path_factory.getbasetemp() / f"release-{kind}"
        if not target.exists():
            family_module("qwen2_vl").write_checkpoint(target, _shrunk(kind), language_model=False)
        return target
    return folder


def _shrunk(kind: str) -> dict:
    from released import SHRUNK, released_config, shrunk

    return shrunk(released_config(kind), SHRUNK[kind])


def family_of(kind: str) -> str:
    return "qwen2_vl" if kind in RELEASE_COPIES else kind


def edited_copy(source: Path, target: Path, edit) -> Path:
    """A copy of a checkpoint folder whose model.safetensors `edit` changed (a dict of tensors, edited in place)."""
    shutil.copytree(source, target)
    tensors = load_file(source / "model.safetensors")
    edit(tensors)
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    return target


def check(kind: str, folder: Path):
    """The family's check of a checkpoint folder, as its load_encoder runs it (on the meta device: no tensor read)."""
    with torch.device("meta"):
        parts, layouts = family_module(family_of(kind)).vision_parts(read_config(folder), folder)
    return load_weights(folder, layouts, parts, read=False)


def reshaped(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.flatten() if tensor.dim() > 1 else tensor[:-1]


@pytest.mark.parametrize("kind,tensor_class", CASES, ids=[f"{kind}-{cls}" for kind, cls in CASES])
def test_a_checkpoint_missing_a_vision_tensor_is_refused_naming_it(checkpoints, tmp_path, kind, tensor_class):
    name = TENSOR_CLASSES[kind][tensor_class]
    folder = edited_copy(checkpoints(kind), tmp_path / "ckpt", lambda tensors: tensors.pop(name))
    with pytest.raises(CheckpointError) as refused:
        check(kind, folder)
    assert f"missing: {name}" in str(refused.value) and str(folder) in str(refused.value)


@pytest.mark.parametrize("kind,tensor_class", CASES, ids=[f"{kind}-{cls}" for kind, cls in CASES])
def test_a_vision_tensor_of_another_shape_is_refused_naming_it_and_its_file(checkpoints, tmp_path, kind,
                                                                             tensor_class):
    name = TENSOR_CLASSES[kind][tensor_class]
    shapes = {}

    def reshape(tensors):
        shapes["was"] = list(tensors[name].shape)
        tensors[name] = reshaped(tensors[name])
        shapes["now"] = list(tensors[name].shape)

    folder = edited_copy(checkpoints(kind), tmp_path / "ckpt", reshape)
    with pytest.raises(CheckpointError) as refused:
        check(kind, folder)
    assert (f"shape: {name} in model.safetensors is {shapes['now']}, config.json makes it {shapes['was']}"
            in str(refused.value))


@pytest.mark.parametrize("kind,extra", [("kimi_k25", "vision_tower.encoder.blocks.0.wqkv_lora.weight"),
                                        ("kimi_k25", "mm_projector.proj.4.weight"),
                                        ("qwen2_vl", "visual.blocks.2.attn.qkv.weight"),
                                        ("qwen3_vl_8b", "model.visual.deepstack_merger_list.3.norm.weight"),
                                        ("siglip2", "vision_model.encoder.layers.2.layer_norm1.weight")])
def test_a_vision_tensor_the_config_has_no_place_for_is_refused_naming_it_and_its_file(checkpoints, tmp_path, kind,
                                                                                     extra):
    folder = edited_copy(checkpoints(kind), tmp_path / "ckpt", lambda tensors: tensors.update({extra: torch.ones(4)}))
    with pytest.raises(CheckpointError, match=f"unexpected: {extra} in model.safetensors"):
        check(kind, folder)


@pytest.mark.parametrize("family_name", all_families())
def test_each_family_refuses_a_broken_checkpoint_when_its_encoder_is_loaded(tmp_path, family_name):
    """Through the family's own load_encoder, as the job (and the estimate, on the meta device) calls it."""
    source = tiny_checkpoint(family_name)
    name = next(iter(TENSOR_CLASSES.get(family_name, TENSOR_CLASSES["kimi_k25"]).values()))
    folder = edited_copy(source, tmp_path / "ckpt", lambda tensors: tensors.pop(name))
    family = load_family(ModelConfig(family=family_name, path=str(folder)))
    for device in ("cpu", "meta"):
        with pytest.raises(CheckpointError, match=f"missing: {name}"):
            family.load_encoder(torch.device(device), torch.float32)


@pytest.mark.parametrize("family_name", all_families())
def test_the_tiny_checkpoints_hold_no_constant_tensor(family_name):
    """No zero bias, no unit norm, no zero table: a tensor that failed to load would change the output. (SigLIP2's
    text side has two one-value tensors, logit_scale and logit_bias, constant by their size.)"""
    with safe_open(tiny_checkpoint(family_name) / "model.safetensors", framework="pt") as tensors:
        constant = [name for name in tensors.keys() if (tensor := tensors.get_tensor(name)).is_floating_point()
                    and tensor.numel() > 1 and tensor.min() == tensor.max()]
    assert constant == []


@pytest.mark.parametrize("family_name", all_families())
def test_the_tiny_checkpoints_are_in_the_released_layout_as_the_header_check_finds_without_reading(family_name):
    encoder = load_family(ModelConfig(family=family_name)).load_encoder(torch.device("meta"), torch.float32)
    assert {source.layout for source in encoder.checked.sources.values()} == {"released"}
    assert all(tensor.is_meta for tensor in encoder.state_dict().values())  # built on the meta device, nothing read


def test_the_header_check_says_what_it_found_and_builds_nothing_but_shapes(kimi_family):
    from batchvlm.families import check_checkpoint

    hidden_sizes, found = check_checkpoint(kimi_family, torch.bfloat16)
    assert hidden_sizes == {"image_embeds": 64}
    assert found.startswith("35 vision tensors in 1 file(s) (model.safetensors), released layout, F32: every one "
                            "present, none unexpected")
