"""Checkpoints loaded whole: the released and the transformers layouts embed alike, only the shards holding vision
tensors are opened, and the estimate and the job refuse a broken one."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from batchvlm.families import ModelConfig
from batchvlm.families import family_module, load_family, tiny_checkpoint
from batchvlm.families.checkpoint import CheckpointError, load_weights, write_weights
from batchvlm.families.common import read_config
from test_checkpoint import TENSOR_CLASSES, edited_copy

# towers run, the estimate and the job's steps
pytestmark = pytest.mark.slow


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


def test_the_job_refuses_a_checkpoint_missing_a_tensor_before_any_work_leaving_nothing(tmp_path):
    """The issue's case: a Kimi copy without one block's wqkv ran, exited 0 and wrote 18 rows of random weights. The
    checkpoint is checked before the inputs are listed: here they match nothing, and the checkpoint is what is named.
    Refused by the job's own steps in this process: a ConfigError, the job's one line and exit 2
    (test_refusals_of_the_job.py)."""
    from conftest import refused_in_process

    name = TENSOR_CLASSES["kimi_k25"]["qkv"]
    broken = edited_copy(tiny_checkpoint("kimi_k25"), tmp_path / "ckpt", lambda tensors: tensors.pop(name))
    (tmp_path / "out").mkdir()
    error = refused_in_process(tmp_path / "out", f"model.path={broken}", "dataset=parquet",
                               f"dataset.path={tmp_path / 'nothing' / '*.parquet'}", run_name="broken")
    assert error.startswith(f"model.path={broken}: ")  # the checkpoint is what is named
    assert f"missing: {name}" in error
    assert not (tmp_path / "out" / "broken").exists()
