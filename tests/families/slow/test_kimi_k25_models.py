"""kimi_k25's towers against the HF model: packed embeddings image by image, other sizes and image tokens, and a
quantization config ignored."""

from __future__ import annotations

import pytest
import torch
from skimage import data
from transformers import Kimi_K25ForConditionalGeneration

from hf_models import pretrained
from photos import demo_images, preprocessed

from test_kimi_k25 import config_copy, load_from

# towers run
pytestmark = pytest.mark.slow


def test_packed_embeddings_equal_the_hf_model_run_on_each_image_alone(kimi_family):
    """Many very different sizes in one packed batch vs the full HF model's get_image_features, image by image."""
    encoder = kimi_family.load_encoder(torch.device("cpu"), torch.float32)
    reference = pretrained(kimi_family.checkpoint, Kimi_K25ForConditionalGeneration, dtype=torch.float32)
    photos = [p for _, p in demo_images()[:8]] + [data.rocket()[150:230], data.chelsea()[140:160, 200:220]]
    rows, grids = preprocessed(kimi_family, photos)
    packed = encoder(torch.cat(rows), torch.tensor(grids))["image_embeds"]
    with torch.inference_mode():
        for image_rows, grid, ours in zip(rows, grids, packed):
            alone = reference.get_image_features(image_rows, torch.tensor([grid])).pooler_output[0]
            assert ours.shape == alone.shape
            scale = alone.abs().max()
            assert (ours - alone).abs().max() <= 1e-4 * scale + 1e-6


def test_a_moonvit_of_other_sizes_and_another_image_token_loads_by_its_own_config(tmp_path, kimi_family):
    """A user's MoonViT (or a K3's): other widths, depth, heads, position table, LLM width, and its image token at
    another id; every one taken from its config.json."""
    import shutil

    from batchvlm.families.kimi_k25 import IMAGE_TOKEN, demo_tokenizer, released_config, write_checkpoint

    tokenizer = demo_tokenizer(ids={IMAGE_TOKEN: 700})
    config = released_config(dict(vt_hidden_size=48, vt_intermediate_size=96, vt_num_hidden_layers=1,
                                  vt_num_attention_heads=3, init_pos_emb_height=8, init_pos_emb_width=8), tokenizer)
    config["vision_config"]["text_hidden_size"] = config["text_config"]["hidden_size"] = 40
    write_checkpoint(tmp_path, config, language_model=False)
    tokenizer.save_pretrained(tmp_path)
    shutil.copy(kimi_family.checkpoint / "preprocessor_config.json", tmp_path)
    family, encoder = load_from(tmp_path)
    assert family.image_token_id == config["media_placeholder_token_id"] == 700
    assert encoder.tower.config.hidden_size == 48 and encoder.hidden_sizes == {"image_embeds": 40}
    rows, grids = preprocessed(family, [data.coffee()[:120, :200]])
    assert encoder(rows[0], torch.tensor(grids))["image_embeds"][0].shape == (family.plan(120, 200).num_tokens, 40)


def test_the_language_models_quantization_config_is_ignored(tmp_path, kimi_family):
    """Kimi-K2.5's LLM is published INT4 in compressed-tensors format; the job reads no tensor of it, so it needs none
    of that format's code: the tiny checkpoint with the released text_config.quantization_config embeds as without."""
    import sys

    from released import released_config

    quantization = released_config("kimi_k25")["text_config"]["quantization_config"]
    assert quantization["quant_method"] == "compressed-tensors"
    folder = config_copy(kimi_family.checkpoint, tmp_path / "ckpt",
                         lambda config: config["text_config"].update(quantization_config=quantization))
    family, encoder = load_from(folder)
    rows, grids = preprocessed(family, [data.coffee()[:120, :200]])
    quantized = encoder(rows[0], torch.tensor(grids))["image_embeds"][0]
    plain = kimi_family.load_encoder(torch.device("cpu"), torch.float32)(rows[0], torch.tensor(grids))["image_embeds"]
    assert torch.equal(quantized, plain[0])
    assert "compressed_tensors" not in sys.modules
