"""Stored features for a stack that feeds the model pixels: the model's own image-feature function replaced.

Stacks that build `pixel_values` in their collator and call `forward(pixel_values=...)` (and models whose
`forward` has no `mm_encoder_outputs`) still reach the image features through `get_image_features`, the public
override point of transformers' vision-language models: `forward` calls it and scatters what it returns into the
image tokens. Replaced, it returns the batch's stored rows and the vision tower never runs, whatever pixels the stack
passed. Rows stored before the projector (`tower_embeds`, `model.embedding=both`) go through the model's own
projector, which then trains; rows stored after it (`image_embeds`) go in as they are.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from batchvlm.training.model_inputs import PaddedBatch, encoder_output
from batchvlm.training.packing import PackedBatch

PRE_PROJECTOR = "tower_embeds"


def vision_tower(model) -> torch.nn.Module:
    """The model's vision tower (Qwen's holds its merger, the projector)."""
    inner = model.model
    return inner.vision_tower if hasattr(inner, "vision_tower") else inner.visual


def projector(model) -> torch.nn.Module:
    """The module that turns the tower's merged features into the language model's image tokens."""
    inner = model.model
    if hasattr(inner, "mm_projector"):  # Kimi-K2.5
        return inner.mm_projector
    if hasattr(inner, "visual") and hasattr(inner.visual, "merger"):  # Qwen2/2.5-VL
        return inner.visual.merger
    raise ValueError(f"{type(model).__name__}: batchvlm knows no projector of it to feed {PRE_PROJECTOR} through")


def projected(model, rows: torch.Tensor) -> torch.Tensor:
    """Pre-projector rows ([tokens, merge_area * D], a merge window's patches side by side) through the projector."""
    module = projector(model)
    dtype = next(module.parameters()).dtype
    if hasattr(model.model, "mm_projector"):  # takes [tokens, merge_area, D]
        area = int(torch.tensor(model.model.vision_tower.merge_kernel_size).prod())
        return module(rows.view(rows.shape[0], area, -1).to(dtype)).squeeze(1)
    if getattr(model.config.vision_config, "deepstack_visual_indexes", None):
        raise ValueError("Qwen3-VL: its deepstack layers come from inside the tower, not from the pre-projector rows; "
                         "feed image_embeds and deepstack_embeds (model_inputs)")
    width = module.ln_q.normalized_shape[0]  # the merger normalizes each patch, then joins a window's
    return module(rows.reshape(-1, width).to(dtype))


@contextmanager
def stored_image_features(model, batch: PackedBatch | PaddedBatch, column: str = "image_embeds"):
    """Within the block, the model's image features are the batch's stored rows of `column` (`image_embeds`, or
    `tower_embeds` fed through the projector), in the order of its image tokens; its tower is not called."""
    inner = model.model
    if column == PRE_PROJECTOR and PRE_PROJECTOR not in getattr(batch, "extras", {}):
        raise ValueError(f"the batch has no {PRE_PROJECTOR}: the run was written without model.embedding=both")

    def get_image_features(*_, **__):
        if column == PRE_PROJECTOR:
            from transformers.modeling_outputs import BaseModelOutputWithPooling

            return BaseModelOutputWithPooling(pooler_output=(projected(model, batch.extras[PRE_PROJECTOR]),))
        return encoder_output(batch.image_embeds, batch.deepstack_embeds)

    inner.get_image_features = get_image_features  # the instance's, over the class's: forward calls this one
    try:
        yield
    finally:
        del inner.get_image_features
