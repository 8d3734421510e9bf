"""Stored features for a stack that feeds the model pixels: the model's own image-feature function replaced.

Stacks that build `pixel_values` in their collator and call `forward(pixel_values=...)` (and models whose
`forward` has no `mm_encoder_outputs`) still reach the image features through `get_image_features`, the public
override point of transformers' vision-language models: `forward` calls it and scatters what it returns into the
image tokens. Replaced, it returns the batch's stored rows and the vision tower never runs, whatever pixels the stack
passed. Rows stored before the projector (`tower_embeds`, `model.embedding=both`) go through the model's own
projector, which then trains; rows stored after it (`image_embeds`) go in as they are.

A SigLIP2 run stores the tower's patch tokens themselves (`image_embeds`, [h * w, D] per image in raster order, its
NaFlex grid (1, h, w) in `grid_thw`): before any projector. A model built on a SigLIP2 tower with a pixel-unshuffle
projector (LFM2-VL: `multi_modal_projector` over `downsample_factor` x `downsample_factor` blocks of patches) gets
them through that projector, image by image; rows that do not fit it (another hidden size, a grid the blocks do not
tile) are refused before the model runs.
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
    if unshuffles_patches(model):
        return inner.multi_modal_projector
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


def unshuffles_patches(model) -> bool:
    """A SigLIP2 tower whose patch tokens the projector merges in blocks of `downsample_factor`^2 (LFM2-VL)."""
    vision = getattr(model.config, "vision_config", None)
    return (getattr(vision, "model_type", None) == "siglip2_vision_model"
            and hasattr(model.config, "downsample_factor") and hasattr(model.model, "multi_modal_projector"))


def check_patch_rows(model, batch: PackedBatch | PaddedBatch) -> None:
    """Refuses stored SigLIP2 rows that the model's projector cannot take, naming what differs."""
    grids, stored, size = batch.grid_thw, batch.image_embeds.shape[-1], model.config.vision_config.hidden_size
    if stored != size:
        raise ValueError(f"stored image_embeds are {stored} wide but {type(model).__name__}'s SigLIP2 tower gives {size}: "
                         "the run was written with another tower")
    factor = model.config.downsample_factor
    for index, (frames, height, width) in enumerate(grids.tolist()):
        if frames != 1 or height % factor or width % factor:
            raise ValueError(f"image {index} of the batch ({', '.join(batch.ids)}) has the patch grid "
                             f"{frames}x{height}x{width}: the projector merges {factor}x{factor} blocks of patches of "
                             f"one frame, so both sides must be multiples of downsample_factor={factor}")
    if int((grids[:, 1] * grids[:, 2]).sum()) != len(batch.image_embeds):
        raise ValueError(f"the batch's grids cover {int((grids[:, 1] * grids[:, 2]).sum())} patches but it holds "
                         f"{len(batch.image_embeds)} image_embeds rows")


def unshuffled_patches(model, batch: PackedBatch | PaddedBatch,
                       spatial_shapes: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """Each image's stored patch tokens as a [1, h, w, D] grid through the model's projector: the pixel-unshuffle
    and MLP its own get_image_features applies to the tower's output, [h * w / factor^2, text hidden] per image."""
    grids = batch.grid_thw
    if spatial_shapes is not None and not torch.equal(spatial_shapes.cpu().long(), grids[:, 1:]):
        raise ValueError(f"the stack's images have the patch grids {spatial_shapes.tolist()} but the stored rows "
                         f"{grids[:, 1:].tolist()}: its prompt's image tokens were counted for other images")
    module = projector(model)
    dtype = next(module.parameters()).dtype
    images = batch.image_embeds.split((grids[:, 1] * grids[:, 2]).tolist())
    return tuple(module(rows.view(1, height, width, -1).to(dtype)).flatten(0, 2)
                 for rows, (_, height, width) in zip(images, grids.tolist()))


@contextmanager
def stored_image_features(model, batch: PackedBatch | PaddedBatch, column: str = "image_embeds"):
    """Within the block, the model's image features are the batch's stored rows of `column` (`image_embeds`, or
    `tower_embeds` fed through the projector), in the order of its image tokens; its tower is not called."""
    inner = model.model
    patches = unshuffles_patches(model)
    if patches:
        if column != "image_embeds":
            raise ValueError(f"{type(model).__name__}: a SigLIP2 run's image_embeds are already the tower's patch "
                             f"tokens, before the projector; feed column='image_embeds', not {column!r}")
        check_patch_rows(model, batch)
    elif column == PRE_PROJECTOR and PRE_PROJECTOR not in getattr(batch, "extras", {}):
        raise ValueError(f"the batch has no {PRE_PROJECTOR}: the run was written without model.embedding=both")

    def get_image_features(*_, spatial_shapes=None, **__):
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        if patches:
            return BaseModelOutputWithPooling(
                pooler_output=unshuffled_patches(model, batch, spatial_shapes))
        if column == PRE_PROJECTOR:
            return BaseModelOutputWithPooling(pooler_output=(projected(model, batch.extras[PRE_PROJECTOR]),))
        return encoder_output(batch.image_embeds, batch.deepstack_embeds)

    inner.get_image_features = get_image_features  # the instance's, over the class's: forward calls this one
    try:
        yield
    finally:
        del inner.get_image_features


# LLaVA (github.com/haotian-liu/LLaVA, llava/model/llava_arch.py): `LlavaMetaForCausalLM.encode_images(images)` takes
# the batch's images as one [N, 3, H, W] tensor and returns `get_model().mm_projector(get_model().get_vision_tower()
# (images))`, [N, P, D]: the tower's selected layer (`mm_vision_select_layer`, CLS dropped), then the projector.
# `prepare_inputs_labels_for_multimodal` takes one [P, D] slice per image placeholder, in order, and for a list of
# images splits that tensor along its first dimension, so it must stay one tensor of equal-sized images.

@contextmanager
def stored_encode_images(model, batch: PackedBatch | PaddedBatch, column: str = "image_embeds"):
    """Within the block, the LLaVA model's `encode_images` returns the batch's stored rows of `column` (the tower's
    selected-layer patch features, before the projector) through its own `mm_projector`, which then trains, as the
    [N, P, D] tensor LLaVA expects; its vision tower is not called."""
    rows = stored_rows(batch, column)
    module = model.get_model().mm_projector
    images = equal_images(batch, rows, projector_width(module))

    def encode_images(*_, **__):
        return module(images.to(next(module.parameters()).dtype))

    model.encode_images = encode_images  # the instance's, over the class's: prepare_inputs_... calls this one
    try:
        yield
    finally:
        del model.encode_images


def stored_rows(batch: PackedBatch | PaddedBatch, column: str) -> torch.Tensor:
    if column == "image_embeds":
        return batch.image_embeds
    if column not in getattr(batch, "extras", {}):
        raise ValueError(f"the batch has no {column}: the run was written without it (model.embedding=both stores "
                         f"{PRE_PROJECTOR})")
    return batch.extras[column]


def projector_width(module: torch.nn.Module) -> int:
    """The feature width the projector takes: its first linear layer's input."""
    return next(layer for layer in module.modules() if isinstance(layer, torch.nn.Linear)).in_features


def equal_images(batch: PackedBatch | PaddedBatch, rows: torch.Tensor, width: int) -> torch.Tensor:
    """The rows as [images, patches per image, D]; refused unless every image has the same grid (LLaVA's images are
    all one size) and the rows are as wide as the projector takes."""
    if rows.shape[-1] != width:
        raise ValueError(f"stored rows are {rows.shape[-1]} wide but the model's mm_projector takes {width}: the run "
                         "was written with another tower or layer")
    grids = batch.grid_thw
    if len(grids) == 0:
        raise ValueError(f"the batch ({', '.join(batch.ids)}) has no image: LLaVA calls encode_images only for images")
    if not (grids == grids[0]).all():
        raise ValueError(f"the batch's images have the grids {grids.tolist()}: LLaVA's encode_images returns one "
                         "[images, patches, D] tensor, so every image must have the same patch grid")
    return rows.view(len(grids), -1, width)


# ms-swift (github.com/modelscope/ms-swift, swift/template/base.py): a multimodal template registers
# `pre_forward_hook` on the model, which calls `template._post_encode(model, kwargs)` on the collator's batch and
# forwards what it returns, plus those of the batch's own keys it keeps (input_ids, attention_mask, labels,
# position_ids, the flash-attention bounds...) where the returned dict has none; `input_ids` is dropped when
# `inputs_embeds` is returned, and every other key of the batch is dropped. `Qwen2VLTemplate._post_encode`
# (swift/template/templates/qwen.py) embeds `input_ids`, runs `model.visual` on the batch's `pixel_values` and
# scatters its output at the image and video pad tokens: `{"inputs_embeds": ...}`.

def stored_post_encode(model, inputs: dict) -> dict:
    """ms-swift's `Template._post_encode(model, inputs)` for Qwen2/2.5/3-VL over stored features: `inputs` are the
    keyword arguments batchvlm gives for a batch (`model_inputs(model, batch)` of a loader's batch, or what
    `RowCollator` returns for rows), whose `mm_encoder_outputs` go in at the image and clip tokens of `input_ids` as
    `inputs_embeds` (out of place: the embedding table trains); the vision tower is never called. Also returned, so
    that the forward gets them whatever the hook keeps of the batch: the stored `position_ids` (`[4, B, L]`, the
    text row then the M-RoPE rows the job computed from each record's grids, restarted per packed record; without
    them the model would give the image tokens text positions) and `use_cache` (which the hook would drop: a cache
    stops transformers masking attention per packed record).

    Qwen3-VL's template differs by more than its deepstack layers: its `_post_encode` returns the batch as it is and
    the model runs the tower in `forward`, where the deepstack layers go in at the image tokens it finds in
    `input_ids`, so no `inputs_embeds` can carry them. For a batch with deepstack layers the shim returns `input_ids`
    with the stored rows as `mm_encoder_outputs` (which `forward` takes in transformers 5, skipping the tower), the
    stored positions and `use_cache`."""
    pixels = sorted(key for key in ("pixel_values", "pixel_values_videos") if inputs.get(key) is not None)
    if pixels:
        raise ValueError(f"the batch holds {pixels}: it comes from a collator of pixels, not of stored features "
                         "(the template's data_collator must give batchvlm's inputs: model_inputs or RowCollator)")
    if "position_ids" not in inputs:
        raise ValueError("the batch has no position_ids: without the stored M-RoPE positions the image tokens would "
                         "train at text positions")
    outputs = inputs.get("mm_encoder_outputs") or {}
    kept = {key: inputs[key] for key in ("position_ids", "use_cache") if key in inputs}
    if any(getattr(output, "deepstack_features", None) is not None for output in outputs.values()):
        return {"input_ids": inputs["input_ids"], "mm_encoder_outputs": outputs, **kept}
    input_ids = inputs["input_ids"]
    embeds = model.get_input_embeddings()(input_ids)
    config = model.config
    for kind, token_id in (("image", config.image_token_id), ("video", config.video_token_id)):
        embeds = scattered_at(embeds, input_ids == token_id, outputs.get(kind), kind)
    return {"inputs_embeds": embeds, **kept}


def scattered_at(embeds: torch.Tensor, at: torch.Tensor, output, kind: str) -> torch.Tensor:
    """`embeds` with the encoder output's rows in place of the tokens `at` marks, in sequence order; refused when
    the rows and the tokens differ in number (the prompt was counted for other images)."""
    rows = torch.cat(output.pooler_output) if output is not None else embeds.new_zeros(0, embeds.shape[-1])
    if int(at.sum()) != len(rows):
        raise ValueError(f"the batch's input_ids hold {int(at.sum())} {kind} tokens but its stored {kind} rows are "
                         f"{len(rows)}: the prompt was counted for other {kind}s")
    if not len(rows):
        return embeds
    return embeds.masked_scatter(at.unsqueeze(-1).to(embeds.device), rows.to(embeds.device, embeds.dtype))
