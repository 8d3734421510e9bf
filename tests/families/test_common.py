"""What the families share: the tiny checkpoints' tokenizer, and a tower's inputs placed where it reads them."""

from __future__ import annotations

import pytest
import torch

from batchvlm.families.common import tiny_tokenizer
from batchvlm.families.kimi_k25 import MEDIA_TOKENS


def test_building_a_tiny_tokenizer_writes_nothing_to_stdout_or_stderr(capfd):
    tokenizer = tiny_tokenizer(MEDIA_TOKENS)
    assert tokenizer.convert_tokens_to_ids("<|media_pad|>") is not None
    assert capfd.readouterr() == ("", "")  # off a terminal, the BPE trainer's bars were three blank lines


def test_tower_inputs_are_refused_in_another_dtype_or_on_another_device_where_they_are_built(kimi_family):
    """The check a CPU run can make of what a CUDA run needs: a missing cast shows here as it is; a missing copy is
    shown with the meta device standing in for another device."""
    from photos import photo_of_size, preprocessed

    from batchvlm.families.common import TowerInputError, check_tower_inputs

    encoder = kimi_family.load_encoder(torch.device("cpu"), torch.bfloat16)
    rows, grids = preprocessed(kimi_family, [photo_of_size(56, 84), photo_of_size(28, 28)])
    pixel_values, kwargs = encoder.inputs(torch.cat(rows), torch.tensor(grids))
    assert pixel_values.dtype == torch.bfloat16 and {"position_ids", "interp_indices", "frame_index"} <= set(kwargs)
    with pytest.raises(TowerInputError, match="pixel_values is torch.float32 on cpu"):
        check_tower_inputs(encoder.tower, torch.cat(rows), kwargs, host=("cu_seqlens",))
    elsewhere = {**kwargs, "position_ids": kwargs["position_ids"].to("meta")}
    with pytest.raises(TowerInputError, match="position_ids is on meta"):
        check_tower_inputs(encoder.tower, pixel_values, elsewhere, host=("cu_seqlens",))
    on_device = {**kwargs, "cu_seqlens": kwargs["cu_seqlens"].to("meta")}  # sdpa reads it with .tolist()
    with pytest.raises(TowerInputError, match="cu_seqlens is on meta"):
        check_tower_inputs(encoder.tower, pixel_values, on_device, host=("cu_seqlens",))


@pytest.mark.parametrize("attention", ["sdpa", "flash_attention_2"])
def test_attention_boundaries_go_where_the_attention_reads_them(kimi_family, attention):
    """flash_attention_2 reads cu_seqlens on the device, with the longest segment as an int (no .item() in the
    tower); the others split the batch with cu_seqlens.tolist(), which costs no sync on the host."""
    from batchvlm.families.common import tower_inputs

    tower = kimi_family.load_encoder(torch.device("cpu"), torch.float32).tower
    cu_seqlens = torch.tensor([0, 16, 20, 56], dtype=torch.int32)
    _, kwargs = tower_inputs(tower, torch.zeros(56, 3, 14, 14), attention, {}, {"cu_seqlens": cu_seqlens})
    assert kwargs["cu_seqlens"].tolist() == [0, 16, 20, 56]
    assert kwargs["max_seqlen"] == (36 if attention == "flash_attention_2" else None)
