"""Encode: the family's tower on a packed batch (varlen, no padding), split back per image and checked.

A batch runs in two halves, so that the host can launch the next batch in between: `launch_batch` queues the tower,
the checks' counts and the outputs in the stored dtype, and their copies to the host behind them; `finish_batch`
waits for those copies (the batch's one sync, through the `Syncs` seam), then checks and splits per record.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchvlm.checks import CheckFailed, require
from batchvlm.devices import Syncs, to_device, to_host
from batchvlm.format.schema import clip_column
from batchvlm.records import EncodedRecord, ImagePlan, PixelBatch


class PixelsNotFinite(RuntimeError):
    """Preprocessing left a value unwritten or not finite in a batch whose check was deferred to the batch's one
    read-back: the batch is redone on the checked path, which finds the image and redoes or quarantines it."""


@dataclass
class Launched:
    """A batch whose tower (and everything read back of it) is queued; on the host once `ready` has passed."""

    batch: PixelBatch
    host: dict[str, torch.Tensor]  # each output, the images joined, in the stored dtype
    sizes: dict[str, list[int]]  # rows of each image in each output
    flags: torch.Tensor  # NaN/Inf counts per output and image, then per image 1 where its pixels were not finite
    ready: torch.cuda.Event | None


def expected_rows(name: str, plan: ImagePlan) -> int:
    """A pooled vector per frame (an image is one frame, a SigLIP2 clip's grid counts its frames), else a row per
    token."""
    return plan.grid_thw[0] if name == "pooled_embeds" else plan.num_tokens


def cu_seqlens_of(grid_thw: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(grid_thw.prod(-1).cumsum(0), (1, 0)).to(torch.int32)


def check_packing(batch: PixelBatch) -> None:
    """On the host: the pixel rows' count is a shape, the grids are the host's."""
    rows = int(batch.pixel_values.shape[0])
    cu = cu_seqlens_of(batch.grid_thw)
    total = int(batch.grid_thw.prod(-1).sum())
    require(rows == total, "encode.packed_tokens", "packed rows do not match the grids of the batch",
            expected=total, observed=rows)
    require(int(cu[0]) == 0 and bool((cu[1:] > cu[:-1]).all()) and int(cu[-1]) == rows, "encode.packed_tokens",
            "cu_seqlens must start at 0, increase strictly and end at the packed row count",
            expected=f"0 .. {rows}, increasing", observed=cu.tolist())


def encode_batch(encoder, batch: PixelBatch, out_dtype: torch.dtype | None = None,
                 syncs: Syncs | None = None) -> list[EncodedRecord]:
    """Run the tower on a packed batch and split its outputs per record, checked."""
    return finish_batch(launch_batch(encoder, batch, out_dtype), syncs or Syncs())


def launch_batch(encoder, batch: PixelBatch, out_dtype: torch.dtype | None = None, stream=None) -> Launched:
    """Queue the tower on the batch, the checks' counts and the outputs' copies to the host (on `stream`, a side
    stream that lets the tower of the next batch start at once). The shapes are checked here, on the host."""
    check_packing(batch)
    outputs = encoder(batch.pixel_values, batch.grid_thw)
    plans = [plan for record in batch.records for plan in record.media_plans]
    owners = [(record, index) for record in batch.records for index in range(len(record.media_plans))]
    for name, tensors in outputs.items():
        require(len(tensors) == len(plans), "encode.output_tokens", f"the tower returned {name} for a different "
                "number of images", expected=len(plans), observed=len(tensors))
        for (record, index), plan, embed in zip(owners, plans, tensors):
            _pinned(record, check_shape, name, index, plan, embed, encoder.hidden_sizes[name])
    stored = {name: torch.cat(tensors).to(out_dtype or tensors[0].dtype) for name, tensors in outputs.items()}
    sizes = {name: [len(t) for t in tensors] for name, tensors in outputs.items()}
    flags = torch.cat([non_finite_counts(stored[name], sizes[name]) for name in stored]
                      + ([(~batch.finite).long()] if batch.finite is not None else []))
    host, ready = to_host([*stored.values(), flags], stream)
    return Launched(batch, dict(zip(stored, host)), sizes, host[-1], ready)


def finish_batch(launched: Launched, syncs: Syncs) -> list[EncodedRecord]:
    """Wait for the batch's copies (its one sync), then check what the device counted and split the outputs per
    record."""
    syncs.wait(launched.ready)
    batch, flags = launched.batch, launched.flags.tolist()
    owners = [(record, index) for record in batch.records for index in range(len(record.media_plans))]
    counted = len(owners) * len(launched.host)
    if any(flags[counted:]):
        raise PixelsNotFinite(f"{sum(flags[counted:])} images of the batch hold pixel values never written or not "
                              "finite")
    for position, name in enumerate(launched.host):
        for (record, index), count in zip(owners, flags[position * len(owners):(position + 1) * len(owners)]):
            _pinned(record, require, count == 0, "encode.finite", f"image {index}: {count} NaN/Inf values in {name}",
                    expected="all finite", observed=f"{count} non-finite", image_index=index)
    per_image = {name: list(joined.split(launched.sizes[name])) for name, joined in launched.host.items()}
    encoded, cursor = [], 0
    for record in batch.records:
        images, media = len(record.plans), len(record.media_plans)
        mine = {name: tensors[cursor:cursor + images] for name, tensors in per_image.items()}
        clips = per_image["image_embeds"][cursor + images:cursor + media]
        if media > images:  # the clips' share of an output with a clip column (deepstack); the others: images only
            mine |= {column: tensors[cursor + images:cursor + media] for name, tensors in per_image.items()
                     if (column := clip_column(name))}
        cursor += media
        embeds = mine.pop("image_embeds")
        encoded.append(EncodedRecord(prepared=record, image_embeds=embeds, extras=mine, video_embeds=clips))
    return encoded


def _pinned(record, check, *args, **kwargs) -> None:
    """Run a per-image check; a failure names the record it belongs to, so the rest of the batch goes on."""
    try:
        check(*args, **kwargs)
    except CheckFailed as failure:
        failure.record = record
        raise


def non_finite_counts(joined: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """NaN/Inf values per image of one output (its images' rows joined), counted on the device without a sync: which
    image a row belongs to is worked out on the host and copied over without a wait."""
    owner = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    per_row = (~torch.isfinite(joined.reshape(len(joined), -1))).sum(-1)
    counts = torch.zeros(len(sizes), dtype=torch.int64, device=joined.device)
    return counts.index_add_(0, to_device(owner, joined.device), per_row)


def check_shape(name: str, index: int, plan: ImagePlan, embed: torch.Tensor, hidden_size: int) -> None:
    shape = (expected_rows(name, plan), hidden_size)
    require(tuple(embed.shape) == shape, "encode.output_tokens",
            f"image {index}: the tower produced {name} of shape {tuple(embed.shape)}, the plan expects {shape}",
            expected=shape, observed=tuple(embed.shape), image_index=index)
