"""Each family read on the configs its checkpoints are published with (tests/families/released/): the processor
parameters and the tower's dims come from the released fields, the tower built from them has exactly the released
tensors' names and shapes, and a tiny copy of each config loads and embeds."""

from __future__ import annotations

import pytest
import torch
from released import FAMILY, RELEASED, released_config, vision_keys

from batchvlm.families import family_module
from batchvlm.families.checkpoint import released_tensors

CLIP = dict(image_mean=(0.48145466, 0.4578275, 0.40821073), image_std=(0.26862954, 0.26130258, 0.27577711))
HALF = dict(image_mean=(0.5,) * 3, image_std=(0.5,) * 3)
PROCESSOR = {
    "kimi_k25": dict(patch_size=14, merge_size=2, max_patches=16384, max_patches_per_side=512, **HALF),
    "qwen2_vl_7b": dict(patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=3136, max_pixels=12845056,
                        **CLIP),
    "qwen2_5_vl_7b": dict(patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=3136, max_pixels=12845056,
                          **CLIP),
    "qwen3_vl_8b": dict(patch_size=16, merge_size=2, temporal_patch_size=2, min_pixels=65536, max_pixels=16777216,
                        **HALF),
    "siglip2_so400m_naflex": dict(patch_size=16, max_num_patches=256, **HALF),
}
"""What each released preprocessor_config.json says, as the model cards give it."""
PARAMS = {"kimi_k25": "KimiProcessorParams", "qwen2_vl": "QwenProcessorParams", "siglip2": "SiglipProcessorParams"}


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_processor_parameters_are_read_from_each_released_preprocessor_config(name):
    family = family_module(FAMILY[name])
    params = getattr(family, PARAMS[FAMILY[name]]).from_checkpoint(RELEASED / name, {})
    assert params == getattr(family, PARAMS[FAMILY[name]])(**PROCESSOR[name])


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_the_tower_built_from_each_released_config_has_the_released_tensor_names_and_shapes(name):
    """Built on the meta device (no memory, no init) from config.json's released fields, named back by the release's
    layout: the same names as the release's vision tensors, and the same shapes wherever a source gave them."""
    with torch.device("meta"):
        parts, layouts = family_module(FAMILY[name]).vision_parts(released_config(name), RELEASED / name)
    assert all(tensor.is_meta for part in parts.values() for tensor in part.state_dict().values())
    built = {stored: tuple(tensor.shape) for stored, tensor in released_tensors(layouts[0], parts).items()}
    released = vision_keys(name)
    assert sorted(built) == sorted(released)
    assert {key: built[key] for key, shape in released.items() if shape} == {
        key: shape for key, shape in released.items() if shape}


def test_siglip2_whose_release_gives_no_shapes_builds_the_so400m_shapes():
    """vision_keys.txt of SigLIP2 names its tensors only: the shapes so400m's model card gives (width 1152, MLP 4304,
    27 layers, 16x16 patches, a 16x16 position table) are checked here instead."""
    with torch.device("meta"):
        parts, layouts = family_module("siglip2").vision_parts(released_config("siglip2_so400m_naflex"),
                                                               RELEASED / "siglip2_so400m_naflex")
    built = {stored: tuple(tensor.shape) for stored, tensor in released_tensors(layouts[0], parts).items()}
    assert built["vision_model.embeddings.patch_embedding.weight"] == (1152, 3 * 16 * 16)
    assert built["vision_model.embeddings.position_embedding.weight"] == (256, 1152)
    assert built["vision_model.encoder.layers.26.mlp.fc1.weight"] == (4304, 1152)
    assert built["vision_model.head.attention.in_proj_weight"] == (3 * 1152, 1152)
