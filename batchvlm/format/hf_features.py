"""The embedding columns' dtype and hidden size in `datasets`' own schema metadata, so that they survive
`datasets.load_dataset` and what a `datasets.Dataset` goes through after it.

Of a Parquet file's schema metadata `datasets` keeps only its own `huggingface` key
(`{"info": {"features": ...}}`): `Features.from_arrow_schema` takes a column's feature from there where that
feature's Arrow type equals the column's, and infers every other column. The key written here names only the
embedding columns, each as `Value("large_binary")`, what `datasets` infers for them anyway, with an `id` of
`batchvlm:embed:<dtype>:<hidden>`. So it types no column differently, and the id is part of `ds.features`, which
`map`, `select`, `filter`, `save_to_disk`/`load_from_disk` and `to_parquet` carry along.

The JSON is written by hand rather than through `datasets.Features`: importing `datasets` would add about a
second to every job's start for one literal. The tests read it back through `datasets`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING

from batchvlm.format import schema

if TYPE_CHECKING:  # `status` and `verify` read this module's keys without importing torch
    import torch

EMBED_ID_PREFIX = "batchvlm:embed:"
SIZE_KEY = "batchvlm.hidden_size."
"""The prefix of the schema-metadata keys that give each embedding column's hidden size (format.schema.shard_metadata)."""


def features_key(hidden_sizes: dict[str, int], embed_dtype: str) -> str:
    """The value of the `huggingface` schema-metadata key: each embedding column's dtype and hidden size."""
    features = {name: {"dtype": "large_binary", "id": f"{EMBED_ID_PREFIX}{embed_dtype}:{size}", "_type": "Value"}
                for name, size in hidden_sizes.items()}
    return json.dumps({"info": {"features": features}})


def embedding_layouts(features: Mapping | None) -> dict[str, tuple[torch.dtype, int]]:
    """(dtype, hidden size) of each column whose `datasets` feature carries a batchvlm embedding id."""
    layouts = {}
    for name, feature in (features or {}).items():
        feature_id = getattr(feature, "id", None) or ""
        if feature_id.startswith(EMBED_ID_PREFIX):
            dtype, hidden = feature_id.removeprefix(EMBED_ID_PREFIX).split(":")
            layouts[name] = (schema.EMBED_DTYPES[dtype], int(hidden))
    return layouts
