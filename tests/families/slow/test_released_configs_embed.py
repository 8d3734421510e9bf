"""A tiny copy of each released config loads and embeds."""

from __future__ import annotations

import sys

import pytest
import torch
from released import FAMILY, released_config, tiny_copy

# a tokenizer with the release's ids, a tiny tower per checkpoint
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_a_tiny_copy_of_each_released_config_loads_and_embeds(tmp_path_factory, name):
    """Dims shrunk, every other field kept: Kimi's language model keeps its compressed-tensors quantization_config,
    which the job ignores (it reads no tensor of that model); its image token is the release's."""
    from photos import photo_of_size, preprocessed

    from batchvlm.families import ModelConfig
    from batchvlm.families import load_family

    folder = tiny_copy(tmp_path_factory.mktemp(name), name, tmp_path_factory.getbasetemp() / "tokenizers")
    family = load_family(ModelConfig(family=FAMILY[name], path=str(folder)))
    encoder = family.load_encoder(torch.device("cpu"), torch.float32)
    rows, grids = preprocessed(family, [photo_of_size(70, 90), photo_of_size(40, 40)])
    out = encoder(torch.cat(rows), torch.tensor(grids))
    assert [tokens.shape[0] for tokens in out["image_embeds"]] == [family.plan(70, 90).num_tokens,
                                                                 family.plan(40, 40).num_tokens]
    assert all(torch.isfinite(tokens).all() for tokens in out["image_embeds"])
    assert "compressed_tensors" not in sys.modules
    if name == "kimi_k25":
        assert "quantization_config" in released_config(name)["text_config"]
        assert family.image_token_id == released_config(name)["media_placeholder_token_id"] == 163605
