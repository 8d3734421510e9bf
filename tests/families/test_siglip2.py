"""siglip2 (NaFlex) against the reference's worked examples, HF's padded forward image by image, and the former one
tower call per patch count (the one packed call must equal it)."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from photos import demo_images, photo_of_size, preprocessed

from batchvlm.families import ModelConfig
from batchvlm.families import load_family
from batchvlm.families.siglip2 import PackedImages, naflex_size


@pytest.fixture(scope="module")
def siglip():
    return load_family(ModelConfig(family="siglip2"))


@pytest.fixture(scope="module")
def mixed_batch(siglip):
    """Rows and grids of photos with many patch counts, some of them shared (runs of equal length)."""
    photos = [p for _, p in demo_images()[:8]] + [photo_of_size(30, 4000), photo_of_size(1, 1)]
    rows, grids = preprocessed(siglip, photos)
    assert 1 < len({h * w for _, h, w in grids}) < len(grids)
    return rows, grids


def per_patch_count_forward(encoder, rows, grids) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The oracle: what SiglipEncoder did before one packed call, on its own tower under the tower's own attention
    (no mask): one tower call per patch count, the images of that count stacked."""
    tower = encoder.tower
    shapes = [(h, w) for _, h, w in grids]
    lengths = [h * w for h, w in shapes]
    packed_attention = tower.config._attn_implementation
    tower.config._attn_implementation = encoder.attention
    try:
        with torch.inference_mode():
            embedded = torch.split(encoder.embed(torch.cat(rows), shapes), lengths)
            tokens, pooled = [None] * len(rows), [None] * len(rows)
            for length in set(lengths):
                members = [i for i, n in enumerate(lengths) if n == length]
                batch = torch.stack([embedded[i] for i in members])
                hidden = tower.post_layernorm(tower.encoder(inputs_embeds=batch).last_hidden_state)
                heads = tower.head(hidden)
                for row, i in enumerate(members):
                    tokens[i], pooled[i] = hidden[row], heads[row:row + 1]
    finally:
        tower.config._attn_implementation = packed_attention
    return tokens, pooled


def largest_difference(ours: list[torch.Tensor], oracle: list[torch.Tensor]) -> float:
    return max(float((a - b).abs().max()) for a, b in zip(ours, oracle, strict=True))


@pytest.mark.parametrize("width,height,budget,size", [
    (1920, 1080, 256, (192, 336)),
    (64, 64, 256, (256, 256)),  # a 4x upscale
    (1920, 1080, 1024, (384, 672)),
])
def test_naflex_size_matches_the_worked_examples(width, height, budget, size):
    assert naflex_size(height, width, 16, budget) == size


def test_packed_images_give_runs_of_equal_length_and_flash_boundaries():
    images = PackedImages((4, 4, 9, 16), "sdpa")
    assert images.runs() == [(0, 2, 4), (8, 1, 9), (17, 1, 16)]
    assert images.boundaries().tolist() == [0, 4, 8, 17, 33] and images.boundaries().dtype == torch.int32


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_one_packed_call_equals_one_call_per_patch_count(mixed_batch, attention):
    """fp32: the whole mixed batch in one encoder call, each image attending only to itself, gives the tokens and
    pooled vectors of the tower run once per patch count."""
    rows, grids = mixed_batch
    encoder = load_family(ModelConfig(family="siglip2", attn_implementation=attention)).load_encoder(
        torch.device("cpu"), torch.float32)
    packed = encoder(torch.cat(rows), torch.tensor(grids))
    tokens, pooled = per_patch_count_forward(encoder, rows, grids)
    token_error = largest_difference(packed["image_embeds"], tokens)
    pooled_error = largest_difference(packed["pooled_embeds"], pooled)
    print(f"siglip2 packed vs per patch count ({attention}, fp32): tokens {token_error:.2e}, pooled {pooled_error:.2e}")
    assert token_error <= 1e-6 and pooled_error <= 1e-6  # 0.0 on this machine: the same ops on the same rows


def test_attention_across_an_image_boundary_is_caught(siglip, mixed_batch):
    """The comparison above has teeth: the same packed sequence run as one image (the boundaries dropped, every
    token attending to every image) is far from the oracle."""
    rows, grids = mixed_batch
    encoder = siglip.load_encoder(torch.device("cpu"), torch.float32)
    shapes = [(h, w) for _, h, w in grids]
    lengths = [h * w for h, w in shapes]
    with torch.inference_mode():
        sequence = encoder.embed(torch.cat(rows), shapes)[None]
        boundless = PackedImages((sum(lengths),), encoder.attention)
        hidden = encoder.tower.post_layernorm(encoder.tower.encoder(inputs_embeds=sequence, attention_mask=boundless)
                                              .last_hidden_state)[0]
    tokens, _ = per_patch_count_forward(encoder, rows, grids)
    assert largest_difference(list(torch.split(hidden, lengths)), tokens) > 1e-2


def test_flash_attention_2_is_handed_the_image_boundaries_as_cu_seqlens(monkeypatch, mixed_batch):
    """No GPU or flash_attn here: a stand-in for flash_attn_varlen_func (sdpa on each cu_seqlens segment, in flash's
    tokens-first layout) shows the packed path hands it the sorted images' boundaries, one tensor for every layer,
    and puts its output back where the tokens belong."""
    rows, grids = mixed_batch
    encoder = load_family(ModelConfig(family="siglip2")).load_encoder(torch.device("cpu"), torch.float32)
    tokens, pooled = per_patch_count_forward(encoder, rows, grids)
    boundaries, tensors = [], set()

    def varlen(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale):
        boundaries.append(cu_seqlens_q.tolist())
        tensors.add(id(cu_seqlens_q))
        assert cu_seqlens_q.dtype == torch.int32 and torch.equal(cu_seqlens_q, cu_seqlens_k)
        assert max_seqlen_q == max_seqlen_k == int(cu_seqlens_q.diff().max())
        segments = zip(cu_seqlens_q[:-1].tolist(), cu_seqlens_q[1:].tolist())
        return torch.cat([F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (query, key, value)),
                                                         scale=softmax_scale).transpose(0, 1) for a, b in segments])

    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=varlen))
    monkeypatch.setattr(encoder, "attention", "flash_attention_2")
    packed = encoder(torch.cat(rows), torch.tensor(grids))
    lengths = sorted(h * w for _, h, w in grids)
    assert boundaries[0] == [sum(lengths[:i]) for i in range(len(lengths) + 1)]
    assert len(boundaries) == encoder.tower.config.num_hidden_layers
    assert len(tensors) == 1  # made once for the batch, not once per layer
    assert largest_difference(packed["image_embeds"], tokens) <= 1e-5
    assert largest_difference(packed["pooled_embeds"], pooled) <= 1e-5


def test_packed_batches_carry_no_padding_rows_where_the_processor_pads(siglip):
    """Packing efficiency on the demo photos: real patches / rows the tower is given."""
    from batchvlm.families.common import processor_inputs

    photos = [p for _, p in demo_images()]
    rows, grids = preprocessed(siglip, photos)
    real = sum(h * w for _, h, w in grids)
    assert sum(image_rows.shape[0] for image_rows in rows) == real
    padded = siglip.reference_processor()(images=processor_inputs(photos), return_tensors="pt")["pixel_values"]
    hf_rows = padded.shape[0] * padded.shape[1]
    print(f"siglip2 demo: packed {real}/{real} = 1.000, HF padded {real}/{hf_rows} = {real / hf_rows:.3f}")
    assert real < hf_rows
