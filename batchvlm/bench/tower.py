"""`python jobs/bench.py task=tower`: the tower alone, in the dtype it runs in (`dtype`, bf16 by default), on the packed
batches of `records` real photos of the common sizes (decoding.REAL_SIZES): images/s, patches/s, and the achieved
TFLOP/s (the batches' matmul FLOPs over the time, `vit_flops`) with its share of `peak_tflops` (model FLOPs
utilization). The tower is the base-size MoonViT (kimi_k25.BASE_VISION, `tower=base`) or the tiny demo one, without
its projector, timed after one warm-up pass, the device synchronized around each pass, the best of `repeats`.
"""

from __future__ import annotations

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


def base_checkpoint() -> Path:
    """The tiny Kimi checkpoint with a ViT-B-sized tower, built once: the tower must cost what a real one does."""
    return build_once(home() / f"demo-{DEMO_VERSION}" / "kimi_k25_base", kimi_k25.write_base_checkpoint)


def vit_flops(config, grids: list[tuple[int, int, int]]) -> int:
    """Matmul FLOPs (two per multiply-add) of a ViT's forward on a packed batch of `grids`: the patch embedding, and in
    each layer the q, k, v and output projections, the two MLP matrices and each image's attention (QK^T and AV over
    its own patches). Norms, activations, rotary terms and softmax are left out, as model FLOPs utilization counts."""
    width, hidden, patch = config.hidden_size, config.intermediate_size, config.patch_size
    lengths = [t * h * w for t, h, w in grids]
    patches = sum(lengths)
    layer = 2 * patches * (4 * width * width + 2 * width * hidden) + sum(4 * n * n * width for n in lengths)
    return 2 * patches * 3 * patch * patch * width + config.num_hidden_layers * layer


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
    """`config`: bench.BenchConfig (records, tower, dtype, device, repeats, peak_tflops)."""
    device = bench_device(config.device)
    family = load_family(tower_model(config))
    encoder = family.load_encoder(device, EMBED_DTYPES[config.dtype])
    batches = packed_batches(family, device, config.records)
    flops = sum(vit_flops(encoder.tower.config, batch.grid_thw.tolist()) for batch in batches)
    patches = sum(int(batch.grid_thw.prod(-1).sum()) for batch in batches)
    seconds = best_seconds(lambda: [encoder(batch.pixel_values, batch.grid_thw) for batch in batches], device,
                           config.repeats)
    tflops = flops / seconds / 1e12
    return {"tower": config.tower, "dtype": config.dtype, "device": str(device), "records": config.records,
            "batches": len(batches), "patches": patches, "images_per_s": config.records / seconds,
            "patches_per_s": patches / seconds, "tflops": tflops, "peak_tflops": config.peak_tflops,
            "mfu": tflops / config.peak_tflops, "repeats": config.repeats}


def format_tower(result: dict) -> str:
    return (f"tower bench: {result['tower']} Kimi tower in {result['dtype']} on {result['device']}, "
            f"{result['records']} real photos in {result['batches']} packed batches ({result['patches']} patches), "
            f"best of {result['repeats']}\n"
            f"{result['images_per_s']:.1f} images/s, {result['patches_per_s']:.0f} patches/s, "
            f"{result['tflops']:.3g} TFLOP/s achieved: {result['mfu']:.2%} of {result['peak_tflops']:.0f} "
            "(model FLOPs utilization)")
