"""Strict loading (families/checkpoint.py), the same for every family: a checkpoint missing a vision tensor, holding
one its config.json has no place for, or one of another shape is refused by name and file before any tensor is read;
the released and transformers layouts give the same embeddings; only the vision tensors are read; the tiny
checkpoints are released-looking, with no tensor left at a constant."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import all_families
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from batchvlm.families import ModelConfig
from batchvlm.families import family_module, load_family, tiny_checkpoint
from batchvlm.families.checkpoint import CheckpointError, load_weights, write_weights
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


@pytest.mark.slow  # three towers, twice
@pytest.mark.parametrize("family_name", ["kimi_k25", "qwen2_vl", "siglip2"])
def test_the_released_and_the_transformers_layout_give_identical_embeddings(tmp_path, family_name):
    """The tiny checkpoint's vision tensors written again under the names transformers holds them by (Kimi's q, k
    and v apart and in rotate-half order, model.visual.*, vision_model.* without its prefix)."""
    from photos import photo_of_size, preprocessed

    source = tiny_checkpoint(family_name)
    with torch.device("meta"):
        parts, layouts = family_module(family_name).vision_parts(read_config(source), source)
    parts = {prefix: part.to_empty(device="cpu") for prefix, part in parts.items()}
    load_weights(source, layouts, parts)
    shutil.copytree(source, tmp_path / "ckpt")
    write_weights(tmp_path / "ckpt" / "model.safetensors", layouts[1], parts)
    transformers_names = {
        "kimi_k25": "model.vision_tower.layers.0.attn.q_proj.weight", "qwen2_vl": "model.visual.blocks.0.attn.qkv.weight",
        "siglip2": "encoder.layers.0.self_attn.q_proj.weight"}[family_name]
    with safe_open(tmp_path / "ckpt" / "model.safetensors", framework="pt") as written:
        assert transformers_names in written.keys()
    photos = [photo_of_size(70, 90), photo_of_size(28, 200)]
    embeddings = []
    for folder in (source, tmp_path / "ckpt"):
        family = load_family(ModelConfig(family=family_name, path=str(folder)))
        encoder = family.load_encoder(torch.device("cpu"), torch.float32)
        assert {source.layout for source in encoder.checked.sources.values()} == {layouts[len(embeddings)].name}
        rows, grids = preprocessed(family, photos)
        embeddings.append(encoder(torch.cat(rows), torch.tensor(grids))["image_embeds"])
    assert all(torch.equal(a, b) for a, b in zip(*embeddings, strict=True))


@pytest.mark.slow  # a sharded copy, and the tower run
def test_only_the_files_holding_vision_tensors_are_opened(tmp_path, kimi_family):
    """A sharded checkpoint whose language model's shard is not even a safetensors file loads and embeds as the
    whole one does: the index sends the job to the vision shard alone."""
    from photos import photo_of_size, preprocessed

    source = kimi_family.checkpoint
    shutil.copytree(source, tmp_path / "ckpt", ignore=shutil.ignore_patterns("model.safetensors"))
    tensors = load_file(source / "model.safetensors")
    vision = {name: tensor for name, tensor in tensors.items() if not name.startswith("language_model.")}
    files = {"model-00001-of-00002.safetensors": sorted(set(tensors) - set(vision)),
             "model-00002-of-00002.safetensors": sorted(vision)}
    save_file(vision, tmp_path / "ckpt" / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
    (tmp_path / "ckpt" / "model-00001-of-00002.safetensors").write_bytes(b"not read" * 64)
    (tmp_path / "ckpt" / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {name: file for file, names in files.items() for name in names}}))
    rows, grids = preprocessed(kimi_family, [photo_of_size(70, 90)])
    sharded = load_family(ModelConfig(path=str(tmp_path / "ckpt"))).load_encoder(torch.device("cpu"), torch.float32)
    whole = kimi_family.load_encoder(torch.device("cpu"), torch.float32)
    assert torch.equal(sharded(rows[0], torch.tensor(grids))["image_embeds"][0],
                       whole(rows[0], torch.tensor(grids))["image_embeds"][0])


def test_the_header_check_says_what_it_found_and_builds_nothing_but_shapes(kimi_family):
    from batchvlm.families import check_checkpoint

    hidden_sizes, found = check_checkpoint(kimi_family, torch.bfloat16)
    assert hidden_sizes == {"image_embeds": 64}
    assert found.startswith("35 vision tensors in 1 file(s) (model.safetensors), released layout, F32: every one "
                            "present, none unexpected")


@pytest.mark.slow  # the estimate samples the demo's records
def test_the_estimate_refuses_a_broken_checkpoint_and_says_what_a_sound_one_holds(tmp_path):
    from batchvlm.sizing.estimate import estimate, format_estimate
    from batchvlm.sizing.estimate import EstimateConfig
    from batchvlm.sources.config import dataset_config

    dataset = dataset_config("demo", unit_records=6)
    report = format_estimate(estimate(EstimateConfig(dataset=dataset, records=3)))
    assert "\ncheckpoint: 35 vision tensors in 1 file(s)" in report
    name = TENSOR_CLASSES["kimi_k25"]["qkv"]
    broken = edited_copy(tiny_checkpoint("kimi_k25"), tmp_path / "ckpt", lambda tensors: tensors.pop(name))
    with pytest.raises(CheckpointError, match=f"missing: {name}"):
        estimate(EstimateConfig(model=ModelConfig(path=str(broken)), dataset=dataset, records=3))


@pytest.mark.slow  # the job's steps over a checkpoint copy
def test_the_job_refuses_a_checkpoint_missing_a_tensor_before_any_work_leaving_nothing(tmp_path):
    """The issue's case: a Kimi copy without one block's wqkv ran, exited 0 and wrote 18 rows of random weights. The
    checkpoint is checked before the inputs are listed: here they match nothing, and the checkpoint is what is named.
    Refused by the job's own steps in this process: a ConfigError, the job's one line and exit 2 (test_refusals.py)."""
    from conftest import refused_in_process

    name = TENSOR_CLASSES["kimi_k25"]["qkv"]
    broken = edited_copy(tiny_checkpoint("kimi_k25"), tmp_path / "ckpt", lambda tensors: tensors.pop(name))
    (tmp_path / "out").mkdir()
    error = refused_in_process(tmp_path / "out", f"model.path={broken}", "dataset=parquet",
                               f"dataset.path={tmp_path / 'nothing' / '*.parquet'}", run_name="broken")
    assert error.startswith(f"model.path={broken}: ")  # the checkpoint is what is named
    assert f"missing: {name}" in error
    assert not (tmp_path / "out" / "broken").exists()
