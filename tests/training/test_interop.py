"""Interop: the run as a `datasets` dataset whose rows become the reader's tensors, and the token types transformers
takes."""

from __future__ import annotations

import pytest
import torch

from batchvlm.format.schema import FRAME, IMAGE, TEXT, VIDEO
from batchvlm.training import minimax_h3_token_types, mm_token_type_ids


def test_minimax_h3_types_cover_every_token_video_0_text_and_frames_1_and_pad_with_minus_1_to_64():
    tags = torch.tensor([TEXT] * 5 + [FRAME] + [VIDEO] * 60 + [FRAME] + [TEXT] * 3, dtype=torch.int8)  # 70 tokens
    types = minimax_h3_token_types(tags)
    assert types.dtype == torch.int64 and types.shape == (128,)  # H3 checks token_tags.shape == (seq_len,)
    assert types[:5].eq(1).all() and types[5] == 1 and types[6:66].eq(0).all() and types[66:70].eq(1).all()
    assert types[70:].eq(-1).all()
    assert minimax_h3_token_types(tags[:64]).tolist() == types[:64].tolist()  # a multiple of 64 gets no pad row
    assert minimax_h3_token_types(tags[None]).tolist() == types.tolist()  # a PackedBatch's [1, L] is one sequence
    assert mm_token_type_ids(tags).tolist() == [0] * 6 + [2] * 60 + [0] * 4  # transformers' mapping of the same tags


def test_the_transformers_mapping_is_unchanged_beside_it():
    tags = torch.tensor([TEXT, FRAME, IMAGE, IMAGE, FRAME, FRAME, VIDEO, VIDEO, FRAME, TEXT], dtype=torch.int8)
    assert mm_token_type_ids(tags).tolist() == [0, 0, 1, 1, 0, 0, 2, 2, 0, 0]


def test_minimax_h3_refuses_image_tokens_unless_told_they_are_conditioning_rows_and_any_unknown_tag():
    tags = torch.tensor([TEXT, FRAME, IMAGE, IMAGE, FRAME, VIDEO], dtype=torch.int8)
    with pytest.raises(ValueError, match=r"no image type .*2 image token\(s\).*images_as_video=True"):
        minimax_h3_token_types(tags)
    assert minimax_h3_token_types(tags, images_as_video=True)[:7].tolist() == [1, 1, 0, 0, 1, 0, -1]
    for images_as_video in (False, True):
        with pytest.raises(ValueError, match=r"never writes: \[-1, 7\]"):
            minimax_h3_token_types(torch.tensor([TEXT, IMAGE, 7, -1], dtype=torch.int8), images_as_video)
    with pytest.raises(ValueError, match=r"one packed sequence.*\[2, 3\]"):
        minimax_h3_token_types(torch.zeros((2, 3), dtype=torch.int8))
