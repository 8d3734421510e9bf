"""Packed attention with no padding (towers.attention): under `varlen` every family's tower makes one attention call
per layer over the whole packed batch, on the images' boundaries, and gives what sdpa's call per image gives."""

from __future__ import annotations

import pytest
import torch

from photos import photo_of_size, preprocessed

from batchvlm.towers import attention
from batchvlm.towers.attention import VARLEN, loaded_as, resolve_attention, use

SIZES = [(56, 84), (112, 112), (28, 28), (112, 112), (84, 140)]
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (bash jobs/gpu_check.sh)")


def test_auto_is_varlen_on_cuda_in_half_precision_and_sdpa_elsewhere():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_attention("auto", cuda, torch.bfloat16) == ("varlen" if attention.torch_varlen() else "sdpa")
    assert resolve_attention("auto", cuda, torch.float32) == resolve_attention("varlen", cpu, torch.bfloat16) == "sdpa"
    assert resolve_attention("eager", cuda, torch.bfloat16) == "eager"
    assert loaded_as("auto") == loaded_as("varlen") == "sdpa" and loaded_as("flash_attention_2") == "flash_attention_2"


def switched_to_varlen(encoder) -> None:
    """What load_encoder does on CUDA in half precision, on the CPU (the stand-in runs there)."""
    if hasattr(encoder, "per_grid") or hasattr(encoder, "version"):  # transformers' towers
        encoder.attention = use(encoder.tower, "varlen")
    else:
        encoder.attention = VARLEN


def test_under_varlen_each_layer_attends_once_over_the_batch_and_gives_sdpas_numbers(family, monkeypatch):
    encoder = family.load_encoder(torch.device("cpu"), torch.float32)
    rows, grids = preprocessed(family, [photo_of_size(h, w) for h, w in SIZES])
    pixel_values, grid_thw = torch.cat(rows), torch.tensor(grids)
    expected = encoder(pixel_values, grid_thw)
    calls = []
    original = attention.varlen

    def counted(query, key, value, cu_seqlens, max_seqlen, scale):
        calls.append((cu_seqlens.diff().tolist(), max_seqlen, query.shape[0]))
        return original(query, key, value, cu_seqlens, max_seqlen, scale)

    monkeypatch.setattr(attention, "varlen", counted)
    monkeypatch.setattr("batchvlm.families.siglip2.varlen", counted)
    switched_to_varlen(encoder)
    ours = encoder(pixel_values, grid_thw)
    layers = encoder.tower.config.num_hidden_layers
    tokens = int(grid_thw.prod(-1).sum())
    assert len(calls) >= layers and all(count == tokens for _, _, count in calls)  # the whole batch, every call
    assert all(sum(lengths) == tokens and longest == max(lengths) for lengths, longest, _ in calls)
    assert ours.keys() == expected.keys()
    for name in ours:
        assert all(torch.equal(a, b) for a, b in zip(ours[name], expected[name])), name


@CUDA
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_on_cuda_torchs_varlen_kernel_gives_each_images_own_attention(dtype):
    if attention.torch_varlen() is None:
        pytest.skip("this torch has no varlen_attn")
    lengths, heads, dim = [300, 17, 1024, 300], 12, 64
    q, k, v = (torch.randn(sum(lengths), heads, dim, device="cuda", dtype=dtype) for _ in range(3))
    cu_seqlens = torch.nn.functional.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32).cuda()
    ours = attention.varlen(q, k, v, cu_seqlens, max(lengths), dim ** -0.5)
    for start, length in zip(cu_seqlens.tolist(), lengths):
        alone = torch.nn.functional.scaled_dot_product_attention(
            *(t[start:start + length].transpose(0, 1)[None].float() for t in (q, k, v)))[0].transpose(0, 1)
        assert (ours[start:start + length].float() - alone).abs().max() < 2e-2
