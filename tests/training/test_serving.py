"""Serving requests from stored rows. Oracles, each engine's rules written out here from its published code (vLLM
@002d181a / @4f5768c7 qwen2_vl.py, qwen3_vl.py; sglang @0001380b base_processor.py, mm_utils.py, kimi_common.py),
independently of batchvlm.training.serving: vLLM's split of image_embeds (prod(grid) // merge**2 rows an image; for
Qwen3-VL the last dim split at the vision output size into the merger's tokens and the deepstack levels) and
sglang's (each run of image tokens in input_ids an image; Qwen3-VL's feature split at the language model's hidden
size) give back every image's stored rows bit for bit; vLLM's expansion of the prompt's placeholders gives back the
stored input_ids; field names, shapes and dtypes are those the engines check, against the checkpoint's config. GPU:
greedy output from stored embeddings == from pixels is left to a machine with vLLM/sglang (none here)."""

from __future__ import annotations

import pytest

from batchvlm.training.serving import SGLANG, VLLM, ServedRun


def test_an_engine_without_embedding_input_for_a_family_is_refused_naming_why():
    with pytest.raises(ValueError, match="vllm cannot serve .*'kimi_k25'.*pixel_values and grid_thws only"):
        ServedRun(VLLM, "kimi_k25")
    with pytest.raises(ValueError, match="sglang cannot serve .*'kimi_k25'.*process_kimi_token_ids_mm_data"):
        ServedRun(SGLANG, "kimi_k25")
    for engine in (VLLM, SGLANG):
        with pytest.raises(ValueError, match="'siglip2'.*patch tokens before a projector"):
            ServedRun(engine, "siglip2")
    with pytest.raises(ValueError, match="engine='tgi'"):
        ServedRun("tgi", "qwen2_vl")
    for merge_size in (0, -2, 1.5, "2"):  # 0 was a ZeroDivisionError at the first record with an image
        with pytest.raises(ValueError, match=rf"^merge_size={merge_size!r} must be a positive integer"):
            ServedRun(VLLM, "qwen2_vl", merge_size)
