"""A batch of stored features as the keyword arguments of the model's own `forward`, never its pixels.

transformers' vision-language models take an encoder's output in place of pixels: `forward(mm_encoder_outputs=
{"image": ...})` scatters its rows into the image tokens of `input_ids` and skips the tower (Qwen2/2.5/3-VL,
Kimi-K2.5 and most others in transformers 5). Qwen3-VL also injects its deepstack layers at the image tokens,
which it finds in `input_ids`, so the stored tokens must go in this way there. A model whose `forward` has no such
argument gets `inputs_embeds` with the rows scattered in. Either way the stored M-RoPE positions go in as
`position_ids`: left out, the model would recompute them from `image_grid_thw` and `mm_token_type_ids`, and a
caller-built `inputs_embeds` without them silently trains on 1-D positions.

Two shapes of batch: a packed one (`PackedBatch`, [1, L], no attention mask: transformers masks attention per record
from the text position row) and a padded one (`pad`, [B, L] with an attention mask), for a trainer that batches rows.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from batchvlm.training.packing import IGNORE_INDEX, PackedBatch, pack
from batchvlm.training.reader import RecordTensors


@dataclass
class PaddedBatch:
    """Records side by side, each as `pack` gives it alone, right-padded to the longest."""
    ids: list[str]
    input_ids: torch.Tensor  # [B, L] int64, pad_id after each record
    labels: torch.Tensor  # [B, L] int64, IGNORE_INDEX on padding
    attention_mask: torch.Tensor  # [B, L] int64, 1 on a record's tokens
    position_ids: torch.Tensor  # [4, B, L] (text row, then M-RoPE t, h, w) for Qwen, else [B, L]; 0 on padding
    image_embeds: torch.Tensor  # [n_image_tokens, hidden], the records' in order
    image_positions: torch.Tensor  # [n_image_tokens]: where each row goes in the flattened [B * L] sequence
    deepstack_embeds: list[torch.Tensor] | None  # Qwen3-VL: one [n_image_tokens, hidden] tensor per layer
    video_embeds: torch.Tensor | None = None  # [n_video_tokens, hidden], the records' clips' tokens in order
    video_positions: torch.Tensor | None = None  # [n_video_tokens]: where each row goes in the flattened sequence
    grid_thw: torch.Tensor | None = None  # [n_images, 3], the records' images in order
    video_deepstack_embeds: list[torch.Tensor] | None = None  # Qwen3-VL: one [n_video_tokens, hidden] per layer


def pad(records: list[RecordTensors], max_tokens: int, pad_id: int = 0) -> PaddedBatch:
    """The records as a [B, L] batch: each one checked as `pack` checks a batch of one, then padded on the right
    with `pad_id` (any token but an image token: the model counts image tokens by id)."""
    alone = [pack([record], max_tokens) for record in records]
    length = max(one.num_tokens for one in alone)

    def stacked(name: str, fill: int) -> torch.Tensor:
        rows = [getattr(one, name) for one in alone]  # [..., 1, n] each
        return torch.cat([torch.nn.functional.pad(row, (0, length - row.shape[-1]), value=fill) for row in rows],
                         dim=-2)

    offsets = [row * length for row in range(len(alone))]
    def layers(name: str) -> list[torch.Tensor] | None:
        with_layers = [getattr(one, name) for one in alone if getattr(one, name) is not None]  # a text has none
        return [torch.cat(level) for level in zip(*with_layers)] if with_layers else None

    clips = [(one, offset) for one, offset in zip(alone, offsets) if one.video_embeds is not None]
    return PaddedBatch(
        ids=[record.id for record in records], input_ids=stacked("input_ids", pad_id),
        labels=stacked("labels", IGNORE_INDEX),
        attention_mask=torch.stack([(torch.arange(length) < one.num_tokens).long() for one in alone]),
        position_ids=stacked("position_ids", 0), image_embeds=torch.cat([one.image_embeds for one in alone]),
        image_positions=torch.cat([one.image_positions + offset for one, offset in zip(alone, offsets)]),
        deepstack_embeds=layers("deepstack_embeds"),
        video_embeds=torch.cat([one.video_embeds for one, _ in clips]) if clips else None,
        video_positions=torch.cat([one.video_positions + offset for one, offset in clips]) if clips else None,
        grid_thw=torch.cat([one.grid_thw for one in alone]),
        video_deepstack_embeds=layers("video_deepstack_embeds"))


def forward_parameters(model) -> set[str]:
    """What a key of `model.forward`'s inputs may be: its named parameters, and where it passes `**kwargs` on to its
    language model (Qwen3-VL's `use_cache`), the language model's."""
    parameters = _named_parameters(model.forward)
    if _passes_kwargs(model.forward) and hasattr(model, "get_decoder"):
        parameters |= _named_parameters(model.get_decoder().forward)
    return parameters


def _named_parameters(function) -> set[str]:
    return {name for name, parameter in inspect.signature(function).parameters.items()
            if parameter.kind not in (parameter.VAR_KEYWORD, parameter.VAR_POSITIONAL)}


def _passes_kwargs(function) -> bool:
    return any(p.kind == p.VAR_KEYWORD for p in inspect.signature(function).parameters.values())


def takes_encoder_outputs(model) -> bool:
    return "mm_encoder_outputs" in forward_parameters(model)


def model_inputs(model, batch: PackedBatch | PaddedBatch) -> dict:
    """The keyword arguments of `model.forward` for one training step on `batch`: `input_ids` with the stored
    tokens as `mm_encoder_outputs` where `forward` takes it, else `inputs_embeds` with them scattered in; `labels`,
    the stored `position_ids`, `attention_mask` for a padded batch, and no cache (`use_cache=False` where `forward`
    or its language model takes it). Never `pixel_values`. Every key is a parameter of `forward` (ValueError naming
    the ones that are not)."""
    parameters = forward_parameters(model)
    inputs = {"labels": batch.labels, "position_ids": batch.position_ids}
    if "use_cache" in parameters:  # a cache stops transformers masking attention per packed record
        inputs["use_cache"] = False
    if isinstance(batch, PaddedBatch):
        inputs["attention_mask"] = batch.attention_mask
    if "mm_encoder_outputs" in parameters:
        inputs["input_ids"] = batch.input_ids
        outputs = {}
        if len(batch.image_embeds):
            outputs["image"] = encoder_output(batch.image_embeds, batch.deepstack_embeds)
        if batch.video_embeds is not None and len(batch.video_embeds):
            outputs["video"] = encoder_output(batch.video_embeds, batch.video_deepstack_embeds)
        if outputs:
            inputs["mm_encoder_outputs"] = outputs
    else:
        if batch.deepstack_embeds is not None or batch.video_deepstack_embeds is not None:
            raise ValueError(f"{type(model).__name__}.forward takes no mm_encoder_outputs, and the batch's "
                             "deepstack layers can only reach their layers through it")
        inputs["inputs_embeds"] = embeds_with_images(model, batch)
    unknown = sorted(set(inputs) - parameters)
    if unknown:
        raise ValueError(f"{type(model).__name__}.forward does not take {unknown}: this model cannot be fed stored "
                         "features by batchvlm")
    return inputs


def encoder_output(embeds: torch.Tensor, deepstack: list[torch.Tensor] | None):
    """The stored rows (the images', or the clips') in the form of the model's own `get_image_features` /
    `get_video_features` output: all their tokens as one piece (the model concatenates the pieces before scattering
    them), Qwen3-VL's deepstack layers beside them."""
    if deepstack is not None:
        from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

        return BaseModelOutputWithDeepstackFeatures(pooler_output=(embeds,),
                                                    deepstack_features=[(layer,) for layer in deepstack])
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    return BaseModelOutputWithPooling(pooler_output=(embeds,))


def embeds_with_images(model, batch: PackedBatch | PaddedBatch) -> torch.Tensor:
    """The text embeddings of `input_ids` with the stored rows in place of the image (and clip) tokens' (out of
    place, so that gradients flow to the embedding table)."""
    embeds = model.get_input_embeddings()(batch.input_ids)
    flat = embeds.reshape(-1, embeds.shape[-1])
    flat = flat.index_put((batch.image_positions.to(flat.device),), batch.image_embeds.to(flat.device, flat.dtype))
    if batch.video_embeds is not None:
        flat = flat.index_put((batch.video_positions.to(flat.device),),
                              batch.video_embeds.to(flat.device, flat.dtype))
    return flat.view_as(embeds)
