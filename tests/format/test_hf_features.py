"""The embedding columns' dtype and hidden size, written in `datasets`' own schema key, read back from the features
that `datasets` builds from it."""

from __future__ import annotations

import json

import datasets
import torch

from batchvlm.format.hf_features import embedding_layouts, features_key


def test_the_key_types_the_embedding_columns_as_datasets_would_and_carries_their_layout():
    key = json.loads(features_key({"image_embeds": 3584, "pooled_embeds": 1152}, "bfloat16"))
    features = datasets.Features.from_dict(key["info"]["features"])
    assert all(feature.dtype == "large_binary" for feature in features.values())
    assert embedding_layouts(features) == {"image_embeds": (torch.bfloat16, 3584),
                                           "pooled_embeds": (torch.bfloat16, 1152)}


def test_columns_without_a_batchvlm_id_have_no_layout():
    assert embedding_layouts(datasets.Features({"text": datasets.Value("string")})) == {}
    assert embedding_layouts(None) == {}
