"""task=train: optimizer steps per second training the model on stored features against training it on pixels.

The same packed batches (the loader's first `steps`), the same model and optimizer, three ways side by side, taking
turns: `stored` (model_inputs: the stored rows as mm_encoder_outputs, no tower), `pixels` (what stacks do today:
the HF image processor on the batch's decoded images in the step, then the frozen tower in the forward) and
`pixels, preprocessed once` (the processor's output cached: the tower alone). The tower is frozen in all three,
as every stack surveyed freezes it by default; the language model trains. `tower=base` (the default) trains
Kimi-K2.5's tiny checkpoint with a ViT-B-sized tower (the language model stays tiny: the ratio is an upper bound
of what skipping the tower saves); `tower=tiny` the tiny checkpoint of `model=`.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from batchvlm.bench.tasks import BenchConfig, Tower, best_interleaved, repeated_demo_run
from batchvlm.bench.tower import base_checkpoint
from batchvlm.demo import demo_rows
from batchvlm.config import ConfigError
from batchvlm.families import ModelConfig, full_model, load_family, resolve_checkpoint
from batchvlm.pipeline.decode import DecodeConfig, decode_image
from batchvlm.training import LoaderConfig, PackedLoader
from batchvlm.training.hooks import vision_tower
from batchvlm.training.model_inputs import forward_parameters, model_inputs


def _batch_images(batches) -> list[list]:
    """Each batch's images in token order, decoded as the job decodes them: a run of the demo records (`run_dir=`) or
    of the repeated demo, whose ids are `<id>-<copy>` (the records the job quarantined are in no batch)."""
    rows = {row["id"]: row["images"] for row in demo_rows()}
    blobs = lambda record: rows[record] if record in rows else rows[record.rsplit("-", 1)[0]]  # noqa: E731
    return [[decode_image(blob, DecodeConfig()).pixels for record in batch.ids for blob in blobs(record)]
            for batch in batches]


def _pixel_inputs(model, batch, pixels: tuple[torch.Tensor, torch.Tensor] | None) -> dict:
    """The batch as a stack feeds it today: input_ids and the processor's pixels, with the batch's positions and
    labels (so that both paths compute the same loss over the same packed attention)."""
    inputs = {"input_ids": batch.input_ids, "position_ids": batch.position_ids, "labels": batch.labels}
    if "use_cache" in forward_parameters(model):
        inputs["use_cache"] = False
    if pixels is not None:
        inputs["pixel_values"], inputs["image_grid_thw"] = pixels
    return inputs


def bench_train(config: BenchConfig) -> dict:
    if config.tower == Tower.released:
        raise ConfigError("tower=released: task=train trains the tiny checkpoints (tower=tiny) or the base-size tower "
                          "(tower=base)")
    if config.tower == Tower.base:  # Kimi-K2.5's tiny checkpoint with a ViT-B-sized tower: a tower that costs
        config = replace(config, model=ModelConfig(family="kimi_k25", path=str(base_checkpoint())))
    run_dir = Path(config.run_dir) if config.run_dir else repeated_demo_run(config)
    family = load_family(config.model)
    model = full_model(resolve_checkpoint(config.model), dtype=torch.float32).train()
    vision_tower(model).requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    loader = PackedLoader(run_dir, LoaderConfig(max_tokens=config.max_tokens, num_workers=0), rank=0, world_size=1)
    batches = [batch for batch, _ in zip(loader, range(config.steps))]
    batch_images = _batch_images(batches)
    preprocessed = [family.reference_preprocess(found) if found else None for found in batch_images]

    def step(inputs: dict) -> None:
        model(**inputs).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    def stored() -> None:
        for batch in batches:
            step(model_inputs(model, batch))

    def pixels() -> None:
        for batch, found in zip(batches, batch_images):
            step(_pixel_inputs(model, batch, family.reference_preprocess(found) if found else None))

    def pixels_preprocessed() -> None:
        for batch, cached in zip(batches, preprocessed):
            step(_pixel_inputs(model, batch, cached))

    seconds = best_interleaved({"stored": stored, "pixels": pixels, "pixels, preprocessed once": pixels_preprocessed},
                               config.repeats)
    return {"run_dir": str(run_dir), "model": type(model).__name__, "steps": len(batches),
            "tokens": sum(batch.num_tokens for batch in batches),
            "images": sum(len(found) for found in batch_images), "max_tokens": config.max_tokens,
            "repeats": config.repeats, "threads": torch.get_num_threads(),
            "paths": {name: {"seconds": s, "steps_per_s": len(batches) / s} for name, s in seconds.items()},
            "ratio": seconds["pixels"] / seconds["stored"],
            "ratio_preprocessed": seconds["pixels, preprocessed once"] / seconds["stored"]}


def format_train(result: dict) -> str:
    lines = [f"train bench: {result['model']} on {result['run_dir']}: {result['steps']} steps of <= "
             f"{result['max_tokens']} tokens ({result['tokens']} tokens, {result['images']} images), tower frozen, "
             f"best of {result['repeats']}, {result['threads']} threads",
             f"{'path':<26} {'steps/s':>9} {'s/pass':>8}"]
    for name, row in result["paths"].items():
        lines.append(f"{name:<26} {row['steps_per_s']:>9.2f} {row['seconds']:>8.2f}")
    lines.append(f"stored / pixels: {result['ratio']:.2f}x; stored / pixels preprocessed once: "
                 f"{result['ratio_preprocessed']:.2f}x")
    return "\n".join(lines)
