"""`python jobs/bench.py task=tower`: the tower alone, in the dtype it runs in (`dtype`, bf16 by default), on the packed
batches of `records` real photos of the common sizes (decoding.REAL_SIZES): images/s, patches/s, and the achieved
TFLOP/s (the batches' model FLOPs over the time, `model_flops`) with its share of `peak_tflops` (model FLOPs
utilization). The tower is the base-size MoonViT (kimi_k25.BASE_VISION, `tower=base`), the tiny demo one, or (with
`tower=released`) the family of `model=` at its released size (RELEASED: Kimi-K2.5's MoonViT, Qwen2-VL-7B's tower,
SigLIP2 so400m), built on the device with random weights: utilization needs the shapes, not the values. Timed under
the attention the job resolves for it (`model.attn_implementation`, auto: varlen on CUDA in half precision) after one
warm-up pass, the device synchronized around each pass, the best of `repeats`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from batchvlm.bench.decoding import REAL_SIZES, photos
from batchvlm.bench.tasks import bench_device, best_seconds, records_of
from batchvlm.families import TINY, ModelConfig
from batchvlm.pipeline.preprocess import PreprocessConfig
from batchvlm.demo import DEMO_VERSION, build_once, home
from batchvlm.executor.batching import TokenBudgetBatcher
from batchvlm.executor.steps import Batching, alone
from batchvlm.families import kimi_k25, load_family
from batchvlm.format.schema import EMBED_DTYPES
from batchvlm.pipeline.preprocess import make_preprocessor, preprocess_batch, resolve_backend
from batchvlm.records import PixelBatch
from batchvlm.towers.attention import resolve_attention


def base_checkpoint() -> Path:
    """The tiny Kimi checkpoint with a ViT-B-sized tower, built once: the tower must cost what a real one does."""
    return build_once(home() / f"demo-{DEMO_VERSION}" / "kimi_k25_base", kimi_k25.write_base_checkpoint)


RELEASED = {
    "kimi_k25": dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                     pos_emb_height=64, pos_emb_width=64, patch_size=14),
    "qwen2_vl": dict(depth=32, embed_dim=1280, hidden_size=3584, mlp_ratio=4, num_heads=16, patch_size=14,
                     spatial_merge_size=2, temporal_patch_size=2),
    "siglip2": dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                    patch_size=16, num_patches=256, vision_use_head=True),
}
"""The vision towers of the released checkpoints (Kimi-K2.5, Qwen2-VL-7B-Instruct, SigLIP2 so400m NaFlex)."""
RELEASED_PROCESSOR = {"qwen2_vl": {"max_pixels": 12845056}}
"""Processor parameters of the released checkpoints where the tiny ones' differ (Qwen2-VL-7B's pixel budget; the tiny
Kimi and SigLIP2 checkpoints keep their released families' own)."""


def released_encoder(family, device: torch.device, dtype: torch.dtype, attention: str) -> torch.nn.Module:
    """The family's encoder around a tower of its released size, built on `device` with random weights."""
    from transformers import Kimi_K25VisionConfig, Kimi_K25VisionModel, Siglip2VisionConfig, Siglip2VisionModel
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    from batchvlm.families.kimi_k25 import KimiEncoder
    from batchvlm.families.qwen2_vl import QwenEncoder
    from batchvlm.families.siglip2 import SiglipEncoder

    size = RELEASED[family.name]
    with torch.device(device):
        if family.name == "kimi_k25":
            tower = Kimi_K25VisionModel._from_config(Kimi_K25VisionConfig(**size), dtype=dtype)
            return KimiEncoder(tower, None, family.params.merge_size, False, attention).eval()
        if family.name == "qwen2_vl":
            tower = Qwen2VisionTransformerPretrainedModel._from_config(Qwen2VLVisionConfig(**size), dtype=dtype)
            return QwenEncoder(tower, "projector", family.params.merge_size, "qwen2_vl", attention).eval()
        tower = Siglip2VisionModel._from_config(Siglip2VisionConfig(**size), dtype=dtype)
        return SiglipEncoder(tower, attention).eval()


def model_flops(encoder: torch.nn.Module, batches: list[PixelBatch]) -> int:
    """FLOPs of the tower's forward on the batches as torch counts them (FlopCounterMode: matmuls, convolutions and
    attention, two per multiply-add), under eager attention, whose matmuls torch counts on any device (its CPU flash
    attention it does not): each image's own attention, as the packed tower computes it."""
    from torch.utils.flop_counter import FlopCounterMode

    attention, transformers_tower = encoder.attention, hasattr(encoder, "per_grid")
    encoder.attention = "eager"
    if transformers_tower:
        loaded, encoder.tower.config._attn_implementation = encoder.tower.config._attn_implementation, "eager"
    try:
        with FlopCounterMode(display=False) as counter:
            for batch in batches:
                encoder(batch.pixel_values, batch.grid_thw)
    finally:
        encoder.attention = attention
        if transformers_tower:
            encoder.tower.config._attn_implementation = loaded
    return counter.get_total_flops()


def tower_model(config, embedding: str = "tower") -> ModelConfig:
    """The bench's checkpoint: the base-size one or the tiny demo one, in `config.dtype`; by default its tower alone."""
    return ModelConfig(path=str(base_checkpoint()) if config.tower == "base" else TINY, device=config.device,
                       dtype=config.dtype, embedding=embedding)


def packed_batches(family, device: torch.device, records: int) -> list[PixelBatch]:
    """`records` real photos, one per record, planned, batched by the default token budget and preprocessed on
    `device` as the job does it."""
    prepared = records_of([(f"photo-{i}", pixels) for i, pixels in enumerate(photos(records, REAL_SIZES))], family)
    defaults = PreprocessConfig()
    batches = alone(Batching(TokenBudgetBatcher(defaults.token_budget, defaults.max_images_per_batch)), prepared)
    preprocessor = make_preprocessor(resolve_backend("auto", device), family, device, defaults.background)
    return [preprocess_batch(batch.records, preprocessor) for batch in batches]


def bench_tower(config) -> dict:
    """`config`: bench.BenchConfig (records, tower, model, dtype, device, repeats, peak_tflops)."""
    device, dtype = bench_device(config.device), EMBED_DTYPES[config.dtype]
    if config.tower == "released":
        processor = {**RELEASED_PROCESSOR.get(config.model.family, {}), **config.model.processor}
        family = load_family(dataclasses.replace(config.model, processor=processor))
        attention = resolve_attention(config.model.attn_implementation, device, dtype)
        encoder = released_encoder(family, device, dtype, attention)
    else:
        family = load_family(tower_model(config))
        encoder = family.load_encoder(device, dtype)
    batches = packed_batches(family, device, config.records)
    flops = model_flops(encoder, batches)
    patches = sum(int(batch.grid_thw.prod(-1).sum()) for batch in batches)
    seconds = best_seconds(lambda: [encoder(batch.pixel_values, batch.grid_thw) for batch in batches], device,
                           config.repeats)
    tflops = flops / seconds / 1e12
    return {"tower": config.tower, "family": family.name, "dtype": config.dtype, "device": str(device),
            "attention": encoder.attention, "records": config.records, "batches": len(batches), "patches": patches,
            "images_per_s": config.records / seconds, "patches_per_s": patches / seconds, "tflops": tflops,
            "peak_tflops": config.peak_tflops, "mfu": tflops / config.peak_tflops, "repeats": config.repeats}


def format_tower(result: dict) -> str:
    return (f"tower bench: {result['tower']} {result['family']} tower in {result['dtype']} on {result['device']} "
            f"({result['attention']} attention), "
            f"{result['records']} real photos in {result['batches']} packed batches ({result['patches']} patches), "
            f"best of {result['repeats']}\n"
            f"{result['images_per_s']:.1f} images/s, {result['patches_per_s']:.0f} patches/s, "
            f"{result['tflops']:.3g} TFLOP/s achieved: {result['mfu']:.2%} of {result['peak_tflops']:.0f} "
            "(model FLOPs utilization)")
