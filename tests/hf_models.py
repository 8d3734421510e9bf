"""transformers' own model of a checkpoint, loaded by its own from_pretrained (which maps the stored names to its
modules itself): the oracle the tests hold the job's embeddings and stored outputs to."""

from __future__ import annotations

import json
from pathlib import Path


def pretrained(checkpoint, model_class=None, **kwargs):
    """`model_class.from_pretrained(checkpoint, **kwargs)` in eval mode (AutoModelForImageTextToText by default).

    Kimi's released config.json names the tower's dims as transformers does not read them (`vt_*`, `init_pos_emb_*`):
    the family's reading of them (kimi_k25.hf_config) is handed over as the config; the tensors are still found and
    converted (fused wqkv, rotary order) by transformers' own code."""
    from transformers import AutoModelForImageTextToText

    from batchvlm.families import kimi_k25

    raw = json.loads((Path(checkpoint) / "config.json").read_text())
    if raw.get("model_type") == "kimi_k25":
        kwargs["config"] = kimi_k25.hf_config(raw, Path(checkpoint))
    return (model_class or AutoModelForImageTextToText).from_pretrained(checkpoint, **kwargs).eval()
