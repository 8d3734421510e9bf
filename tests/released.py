"""The released configs kept under tests/families/released/ (config.json, preprocessor_config.json and the vision
tensors' names and shapes of five published checkpoints; README.md there says where each came from), and tiny copies
of them: every dim shrunk, every other field kept (a language model's quantization_config among them), the vision
tensors written in the release's layout, a tokenizer with the release's special-token ids."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

RELEASED = Path(__file__).resolve().parent / "families" / "released"

FAMILY = {"kimi_k25": "kimi_k25", "qwen2_vl_7b": "qwen2_vl", "qwen2_5_vl_7b": "qwen2_vl", "qwen3_vl_8b": "qwen2_vl",
          "siglip2_so400m_naflex": "siglip2"}
"""Each released checkpoint (a folder of RELEASED) and the family that reads it."""

SHRUNK = {
    "kimi_k25": {"text_config": {"hidden_size": 64},
                 "vision_config": {"vt_hidden_size": 32, "vt_intermediate_size": 64, "vt_num_attention_heads": 2,
                                   "vt_num_hidden_layers": 2, "init_pos_emb_height": 8, "init_pos_emb_width": 8,
                                   "mm_hidden_size": 32, "text_hidden_size": 64}},
    "qwen2_vl_7b": {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                    "vision_config": {"depth": 2, "embed_dim": 32, "num_heads": 2, "hidden_size": 64}},
    "qwen2_5_vl_7b": {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                      "vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                                        "out_hidden_size": 64, "fullatt_block_indexes": [1]}},
    "qwen3_vl_8b": {"text_config": {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                                    "head_dim": 16},
                    "vision_config": {"depth": 3, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                                      "out_hidden_size": 64, "num_position_embeddings": 64,
                                      "deepstack_visual_indexes": [0, 1, 2]}},
    "siglip2_so400m_naflex": {
        "text_config": {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_hidden_layers": 2,
                        "projection_size": 32},
        "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_hidden_layers": 2}},
}
"""The dims each tiny copy shrinks (nested as in config.json): the tower's width, depth, heads and position table, the
projector's widths; the language model's width where the projector's output has it."""

PUBLISHED_IDS = {
    "kimi_k25": {"<|media_begin|>": 163602, "<|media_content|>": 163603, "<|media_end|>": 163604,
                 "<|media_pad|>": 163605},
    "qwen2_vl": {"<|im_start|>": 151644, "<|im_end|>": 151645, "<|vision_start|>": 151652, "<|vision_end|>": 151653,
                 "<|image_pad|>": 151655, "<|video_pad|>": 151656},
    "siglip2": {},
}
"""Where the released tokenizers put each family's media tokens (the ids their config.json reads images at)."""


def released_config(name: str) -> dict:
    return json.loads((RELEASED / name / "config.json").read_text())


def shrunk(config: dict, dims: dict) -> dict:
    """`config` with the values of `dims` (nested alike) in place of its own, every other field as it is."""
    config = copy.deepcopy(config)
    for key, value in dims.items():
        config[key] = shrunk(config[key], value) if isinstance(value, dict) else value
    return config


def tiny_copy(folder: Path, name: str, tokenizers: Path) -> Path:
    """A checkpoint folder of the released config `name` shrunk: its vision tensors (no language model) in the
    release's layout, its preprocessor_config.json as released, a tiny tokenizer with the release's ids (built once
    under `tokenizers`)."""
    from batchvlm.families import family_module

    family = family_module(FAMILY[name])
    family.write_checkpoint(folder, shrunk(released_config(name), SHRUNK[name]), language_model=False)
    shutil.copy(RELEASED / name / "preprocessor_config.json", folder)
    for file in tokenizer(FAMILY[name], tokenizers).iterdir():
        shutil.copy(file, folder)
    return folder


def tokenizer(family_name: str, root: Path) -> Path:
    from batchvlm.families import family_module

    folder = root / family_name
    if not folder.exists():
        family, ids = family_module(family_name), PUBLISHED_IDS[family_name]
        (family.demo_tokenizer(ids) if ids else family.demo_tokenizer()).save_pretrained(folder)
    return folder


def vision_keys(name: str) -> dict[str, tuple[int, ...] | None]:
    """The released vision tensors' names and shapes (None where no source gave the shape) of vision_keys.txt."""
    keys = {}
    for line in (RELEASED / name / "vision_keys.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            tensor, shape, _ = line.split()
            keys[tensor] = None if shape == "?" else tuple(json.loads(shape))
    return keys
