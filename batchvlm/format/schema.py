"""The Parquet contract: the row schemas of data and quarantine shards, the stored embedding dtypes, the extra
embedding columns an encoder may fill, and the values of token_tags. Writers and readers both take them from here."""

from __future__ import annotations

import pyarrow as pa
import torch

import batchvlm
from batchvlm.config import Choice

TEXT, IMAGE, FRAME = 0, 1, 2
"""token_tags values: text, an image-embedding position, a frame token around an image's span."""

EXTRA_OUTPUTS = {
    "tower_embeds": "the tower's features before the projector, grouped per LLM token (model.embedding=both)",
    "pooled_embeds": "one pooled vector per image (SigLIP2's attention-pooling head)",
    "deepstack_embeds": "Qwen3-VL deepstack features per LLM token, the layers concatenated along hidden",
}
"""Outputs an encoder may return beside `image_embeds`; each is stored in its own column."""

class Dtype(Choice):
    """A tower's compute dtype, and the stored embeddings' (model.dtype, output.embed_dtype)."""

    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


EMBED_DTYPES = {Dtype.bfloat16: torch.bfloat16, Dtype.float16: torch.float16, Dtype.float32: torch.float32}

_SIZE = pa.list_(pa.int32(), 2)
TURN = pa.struct([("role", pa.string()), ("start", pa.int32()), ("end", pa.int32())])
"""A rendered turn's tokens [start, end) in input_ids, its end-of-turn token last."""

DATA_SCHEMA = pa.schema([
    ("id", pa.string()),
    ("source", pa.string()),
    ("row", pa.int64()),
    ("text", pa.string()),
    ("input_ids", pa.list_(pa.int32())),
    ("image_spans", pa.list_(pa.struct([("start", pa.int32()), ("length", pa.int32())]))),
    ("token_tags", pa.list_(pa.int8())),
    ("num_tokens", pa.int32()),
    # A conversation's (null for dataset.format=text): which tokens are trained, where each turn lies, how many
    # trailing turns text.overflow=drop_turns left out.
    ("loss_mask", pa.list_(pa.int8())),
    ("turns", pa.list_(TURN)),
    ("dropped_turns", pa.int32()),
    ("grid_thw", pa.list_(pa.list_(pa.int32(), 3))),
    ("original_size", pa.list_(_SIZE)),
    ("resized_size", pa.list_(_SIZE)),
    ("image_sha256", pa.list_(pa.string())),
    ("image_num_tokens", pa.list_(pa.int32())),
    ("num_image_tokens", pa.int32()),
    ("image_embeds", pa.large_binary()),
    # Null where the family has no such output (see EXTRA_OUTPUTS and Family.positions).
    ("tower_embeds", pa.large_binary()),
    ("pooled_embeds", pa.large_binary()),
    ("deepstack_embeds", pa.large_binary()),
    ("position_ids", pa.list_(pa.list_(pa.int32()), 3)),
    ("rope_delta", pa.int32()),
])

QUARANTINE_SCHEMA = pa.schema([
    ("id", pa.string()),
    ("source", pa.string()),
    ("row", pa.int64()),
    ("unit", pa.string()),
    ("stage", pa.string()),
    ("check", pa.string()),
    ("message", pa.string()),
    ("expected", pa.string()),
    ("observed", pa.string()),
    ("exception_type", pa.string()),
    ("image_index", pa.int32()),
    ("image_bytes", pa.list_(pa.large_binary())),
    ("image_paths", pa.list_(pa.string())),
    ("text", pa.string()),
    # A conversation's turns as read (null for dataset.format=text), images as the placeholder, and the turn the
    # failure is about (text.too_long: the first turn past text.max_tokens).
    ("turns", pa.list_(pa.struct([("role", pa.string()), ("text", pa.string())]))),
    ("turn_index", pa.int32()),
    ("fingerprint", pa.string()),
])


def shard_metadata(family: str, hidden_sizes: dict[str, int], embed_dtype: str, embedding: str,
                   fingerprint: str) -> dict[str, str]:
    """Every shard's schema metadata. The `huggingface` key repeats the embedding columns' dtype and hidden sizes for
    `datasets`, which keeps no other key (hf_features); a quarantine shard has none of those columns, and `datasets`
    ignores what the key says of columns a file lacks."""
    from batchvlm.format.hf_features import SIZE_KEY, features_key

    sizes = {f"{SIZE_KEY}{name}": str(size) for name, size in hidden_sizes.items()}
    return {**sizes, "batchvlm.family": family, "batchvlm.hidden_size": str(hidden_sizes["image_embeds"]),
            "batchvlm.embed_dtype": embed_dtype, "batchvlm.embedding": embedding, "batchvlm.fingerprint": fingerprint,
            "batchvlm.version": batchvlm.__version__, "huggingface": features_key(hidden_sizes, embed_dtype)}
