"""kimi_k25 against oracles nobody here wrote: the HF image processor and the HF model's own forward."""

from __future__ import annotations

import re

import pytest
import torch
from skimage import data
from transformers import Kimi_K25ForConditionalGeneration

from photos import preprocessed

from batchvlm.families.kimi_k25 import KimiProcessorParams, navit_plan


@pytest.mark.parametrize("width,height,grid,resized", [
    (1920, 1080, (1, 78, 138), (1080, 1920)),
    (4000, 3000, (1, 112, 150), (1554, 2073)),
    (8000, 8000, (1, 130, 130), (1793, 1793)),
    (100000, 10, (1, 2, 512), (1, 7167)),
    (1, 1, (1, 2, 2), (1, 1)),
])
def test_navit_plan_matches_the_worked_examples(width, height, grid, resized):
    plan = navit_plan(height, width, KimiProcessorParams())
    assert plan.grid_thw == grid and plan.resized == resized
    assert plan.num_tokens == grid[1] * grid[2] // 4


def test_non_square_images_are_not_transposed(kimi_family):
    """The processor bug of early commits transposed W and H; the pinned version and ours agree."""
    photo = data.coffee()[:200, :400]  # 200 tall, 400 wide
    pixel_values, grid = kimi_family.reference_preprocess([photo])
    assert tuple(grid[0].tolist()) == (1, 16, 30)
    (ours,), _ = preprocessed(kimi_family, [photo])
    assert torch.allclose(ours, pixel_values, atol=1e-5)


def test_a_sharded_moe_checkpoint_saved_by_transformers_yields_its_own_tower_and_projector(tmp_path, kimi_family):
    """A fine-tuned model as transformers 5 saves it (its own config.json fields, some names Moonshot's and some its
    own, shards and an index): the vision weights are found in it exactly; the packed output equals the model's."""
    import json

    from batchvlm.families import ModelConfig
    from batchvlm.families import load_family
    from batchvlm.families.common import read_config
    from batchvlm.families.kimi_k25 import hf_config

    config = hf_config(read_config(kimi_family.checkpoint), kimi_family.checkpoint)
    config.text_config.num_hidden_layers = 3  # layers 1 and 2 are mixture-of-experts layers
    torch.manual_seed(1)
    full = Kimi_K25ForConditionalGeneration(config).eval()
    full.save_pretrained(tmp_path, max_shard_size="100KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    kimi_family.tokenizer.save_pretrained(tmp_path)
    processor = json.loads((kimi_family.checkpoint / "preprocessor_config.json").read_text())
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(processor))
    family = load_family(ModelConfig(path=str(tmp_path)))
    encoder = family.load_encoder(torch.device("cpu"), torch.float32)
    assert len({stored.file for stored in encoder.checked.stored}) < len(list(tmp_path.glob("*.safetensors")))
    rows, grids = preprocessed(family, [data.coffee()[:200, :300]])
    with torch.inference_mode():
        ours = encoder(rows[0], torch.tensor(grids))["image_embeds"][0]
        expected = full.get_image_features(rows[0], torch.tensor(grids)).pooler_output[0]
    assert torch.allclose(ours, expected, rtol=1e-5, atol=1e-6)


# -- the checkpoint's config.json, read by the fields Moonshot releases it with ---------------------------------------
def config_copy(source, target, edit):
    """A copy of a checkpoint folder whose config.json `edit` changed (a dict, edited in place)."""
    import json
    import shutil

    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    edit(config)
    (target / "config.json").write_text(json.dumps(config))
    return target


def load_from(folder):
    from batchvlm.families import ModelConfig
    from batchvlm.families import load_family

    family = load_family(ModelConfig(path=str(folder)))
    return family, family.load_encoder(torch.device("cpu"), torch.float32)


def test_the_tower_dims_and_image_token_are_read_from_the_released_fields(kimi_family):
    from batchvlm.families.common import read_config

    raw = read_config(kimi_family.checkpoint)
    vision = raw["vision_config"]
    assert "hidden_size" not in vision and "image_token_id" not in raw  # transformers' own names are not there
    encoder = kimi_family.load_encoder(torch.device("meta"), torch.float32)
    tower = encoder.tower
    assert (tower.config.hidden_size, tower.config.num_hidden_layers, tower.config.num_attention_heads,
            tower.config.intermediate_size) == (vision["vt_hidden_size"], vision["vt_num_hidden_layers"],
                                                vision["vt_num_attention_heads"], vision["vt_intermediate_size"])
    assert tuple(tower.patch_embed.pos_emb.position_embeddings.shape) == (
        vision["init_pos_emb_height"], vision["init_pos_emb_width"], vision["vt_hidden_size"])
    assert encoder.projector.pre_norm.normalized_shape == (vision["mm_hidden_size"],)
    assert encoder.hidden_size == vision["text_hidden_size"]
    assert kimi_family.image_token_id == raw["media_placeholder_token_id"] != 163605  # not transformers' default


def test_a_position_table_the_config_sizes_otherwise_is_refused(tmp_path, kimi_family):
    from batchvlm.families.checkpoint import CheckpointError

    def larger_table(config):
        config["vision_config"].update(init_pos_emb_height=32, init_pos_emb_width=32)

    folder = config_copy(kimi_family.checkpoint, tmp_path / "ckpt", larger_table)
    with pytest.raises(CheckpointError, match=r"shape: vision_tower\.patch_embed\.pos_emb\.weight in model\.safetensors "
                                              r"is \[16, 16, 32\], config\.json makes it \[32, 32, 32\]"):
        load_from(folder)


@pytest.mark.parametrize("edit,refusal", [
    (lambda config: config["vision_config"].update(mm_projector_type="patchmergerv2"),
     "vision_config.mm_projector_type='patchmergerv2', a MoonViT variant"),
    (lambda config: config["vision_config"].pop("vt_hidden_size"), "gives none of vt_hidden_size, hidden_size"),
    (lambda config: config["vision_config"].update(hidden_size=64), "vt_hidden_size=32 and hidden_size=64"),
    (lambda config: config.update(media_placeholder_token_id=5), "image token is 5 but the tokenizer"),
], ids=["variant", "no width", "two widths", "image token"])
def test_a_config_json_that_does_not_say_the_tower_it_holds_is_refused_naming_the_field(tmp_path, kimi_family, edit,
                                                                                       refusal):
    from batchvlm.config import ConfigError

    folder = config_copy(kimi_family.checkpoint, tmp_path / "ckpt", edit)
    with pytest.raises(ConfigError, match=re.escape(refusal)):
        load_from(folder)


@pytest.mark.parametrize("field", ["media_placeholder_token_id", "text_hidden_size"])
def test_a_full_checkpoint_must_name_its_image_token_and_its_llm_width(tmp_path, kimi_family, field):
    """Neither is taken from transformers' defaults (163605, 7168): a checkpoint that does not say is refused."""
    from batchvlm.config import ConfigError

    def without(config):
        config.pop(field, None)
        config["vision_config"].pop(field, None)
        config["text_config"].pop("hidden_size")

    folder = config_copy(kimi_family.checkpoint, tmp_path / "ckpt", without)
    with pytest.raises(ConfigError, match=f"gives none of {field}"):
        load_from(folder)


def test_a_tower_saved_alone_by_transformers_loads_with_its_own_weights(tmp_path, kimi_family):
    """Kimi_K25VisionModel.save_pretrained (config.json of model_type kimi_k25_vision, no prefix on its names): its
    tower's tokens, no projector."""
    import shutil

    from transformers import Kimi_K25VisionModel

    from batchvlm.families.common import read_config
    from batchvlm.families.kimi_k25 import hf_config

    torch.manual_seed(2)
    tower = Kimi_K25VisionModel(hf_config(read_config(kimi_family.checkpoint), kimi_family.checkpoint).vision_config)
    tower.eval().save_pretrained(tmp_path)
    kimi_family.tokenizer.save_pretrained(tmp_path)
    shutil.copy(kimi_family.checkpoint / "preprocessor_config.json", tmp_path)
    family, encoder = load_from(tmp_path)
    assert encoder.projector is None
    rows, grids = preprocessed(family, [data.coffee()[:120, :200]])
    with torch.inference_mode():
        expected = tower(rows[0], grid_thw=torch.tensor(grids)).pooler_output.flatten(1)
    assert torch.equal(encoder(rows[0], torch.tensor(grids))["image_embeds"][0], expected)
