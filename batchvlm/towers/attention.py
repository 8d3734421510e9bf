"""Attention over a packed batch, with no padding: each image attends to its own patches only.

`model.attn_implementation`:
- `varlen`: one call per layer over the whole packed batch, on the images' boundaries (cu_seqlens): torch's own
  variable-length flash attention (`torch.nn.attention.varlen.varlen_attn`, torch >= 2.10), so no flash_attn package
  is needed. The towers of transformers take their flash path for it (one call with cu_seqlens, where sdpa makes one
  call per image), through an attention function of our own registered with transformers' AttentionInterface
  (`VARLEN`, whose name says "flash" for them). Where torch's kernel cannot run (on the CPU, in float32, an older
  torch) the same function makes one SDPA call per image on the same boundaries: what `sdpa` computes, bit for bit,
  so the path runs in the CPU tests.
- `auto` (the default): `varlen` on CUDA in bfloat16 or float16 where torch has it, `sdpa` otherwise.
- `sdpa`, `eager`: transformers' own, one call per image; `flash_attention_2`: flash_attn's varlen kernel.
"""

from __future__ import annotations

import inspect

import torch

VARLEN = "batchvlm_flash_varlen"
"""The name the towers see for `varlen` (transformers' towers take their one-call varlen path for any name with
"flash" in it); registered with transformers' AttentionInterface on first use."""
HALF = (torch.bfloat16, torch.float16)


def torch_varlen():
    """torch's varlen_attn, or None where this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def resolve_attention(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """`auto` and `varlen` made for the device and dtype the tower runs in: `varlen` where torch's kernel runs, `sdpa`
    (the same numbers as varlen's stand-in) elsewhere; any other name as it is."""
    if name not in ("auto", "varlen"):
        return name
    return "varlen" if device.type == "cuda" and dtype in HALF and torch_varlen() is not None else "sdpa"


def loaded_as(name: str) -> str:
    """The implementation a tower is built with by transformers: ours are switched on after loading (`use`)."""
    return "sdpa" if name in ("auto", "varlen") else name


def use(tower: torch.nn.Module, name: str) -> str:
    """The tower switched to `name` where it is ours; returns the implementation it runs (common.tower_inputs places
    the image boundaries for it)."""
    if name != "varlen":
        return loaded_as(name)
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN, varlen_forward)
    tower.config._attn_implementation = VARLEN
    return VARLEN


def varlen_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, scaling=None,
                   dropout: float = 0.0, cu_seq_lens_q: torch.Tensor | None = None, max_length_q: int | None = None,
                   **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention interface ([1, heads, tokens, head_dim] in, [1, tokens, heads, head_dim] out, as its
    flash path returns it), on the image boundaries the tower passes."""
    tokens_first = [tensor[0].transpose(0, 1) for tensor in (query, key, value)]
    return varlen(*tokens_first, cu_seq_lens_q, max_length_q, scaling)[None], None


def varlen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
           scale: float | None) -> torch.Tensor:
    """[tokens, heads, head_dim] each: every segment of cu_seqlens attends to itself only."""
    kernel = torch_varlen()
    if kernel is not None and query.is_cuda and query.dtype in HALF:
        scaled = {"scale": scale} if "scale" in inspect.signature(kernel).parameters else {}
        if not scaled and scale is not None and abs(scale - query.shape[-1] ** -0.5) > 1e-12:
            query = query * (scale * query.shape[-1] ** 0.5)  # torch 2.10's takes no scale: its default, 1/sqrt(d)
        return kernel(query, key, value, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **scaled)
    lengths = cu_seqlens.diff().tolist()  # on the host where this path runs (tower_inputs), else one sync
    per_image = [torch.nn.functional.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in parts),
                                                                  scale=scale)[0].transpose(0, 1)
                 for parts in zip(*(t.split(lengths) for t in (query, key, value)))]
    return torch.cat(per_image)
