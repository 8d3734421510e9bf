"""Encode: the family's tower on a packed batch (varlen, no padding), split back per image and checked."""

from __future__ import annotations

import torch

from batchvlm.checks import CheckFailed, require
from batchvlm.records import EncodedRecord, ImagePlan, PixelBatch


def expected_rows(name: str, plan: ImagePlan) -> int:
    return 1 if name == "pooled_embeds" else plan.num_tokens


def cu_seqlens_of(grid_thw: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(grid_thw.prod(-1).cumsum(0), (1, 0)).to(torch.int32)


def check_packing(batch: PixelBatch) -> None:
    rows = int(batch.pixel_values.shape[0])
    cu = cu_seqlens_of(batch.grid_thw)
    total = int(batch.grid_thw.prod(-1).sum())
    require(rows == total, "encode.packed_tokens", "packed rows do not match the grids of the batch",
            expected=total, observed=rows)
    require(int(cu[0]) == 0 and bool((cu[1:] > cu[:-1]).all()) and int(cu[-1]) == rows, "encode.packed_tokens",
            "cu_seqlens must start at 0, increase strictly and end at the packed row count",
            expected=f"0 .. {rows}, increasing", observed=cu.tolist())


def encode_batch(encoder, batch: PixelBatch, out_dtype: torch.dtype | None = None) -> list[EncodedRecord]:
    """Run the tower on a packed batch and split its outputs per record, checked."""
    return finish_batch(encoder, batch, start_batch(encoder, batch), out_dtype)


def start_batch(encoder, batch: PixelBatch) -> dict[str, list[torch.Tensor]]:
    """The tower's outputs for the batch ({output name: one tensor per image}), as launched: on CUDA the
    kernels are queued and the host is free until `finish_batch` reads the results."""
    check_packing(batch)
    return encoder(batch.pixel_values, batch.grid_thw)


def finish_batch(encoder, batch: PixelBatch, outputs: dict[str, list[torch.Tensor]],
                 out_dtype: torch.dtype | None = None) -> list[EncodedRecord]:
    """The outputs split per record, checked. The checks of the whole batch cost one device sync
    (non-finite values counted per image on the device, read back at once), and the outputs come back
    to the host in one copy per output (in `out_dtype`, the stored one, so only the stored bytes cross
    the bus)."""
    plans = [plan for record in batch.records for plan in record.plans]
    for name, tensors in outputs.items():
        require(len(tensors) == len(plans), "encode.output_tokens", f"the tower returned {name} for a different "
                "number of images", expected=len(plans), observed=len(tensors))
    owners = [(record, index) for record in batch.records for index in range(len(record.plans))]
    for name, tensors in outputs.items():
        for (record, index), plan, embed in zip(owners, plans, tensors):
            _pinned(record, check_shape, name, index, plan, embed, encoder.hidden_sizes[name])
    for (record, index), (name, count) in zip(owners * len(outputs), non_finite_counts(outputs)):
        _pinned(record, require, count == 0, "encode.finite", f"image {index}: {count} NaN/Inf values in {name}",
                expected="all finite", observed=f"{count} non-finite", image_index=index)
    host = {name: to_host(tensors, out_dtype) for name, tensors in outputs.items()}
    encoded, cursor = [], 0
    for record in batch.records:
        mine = {name: tensors[cursor:cursor + len(record.plans)] for name, tensors in host.items()}
        cursor += len(record.plans)
        embeds = mine.pop("image_embeds")
        encoded.append(EncodedRecord(prepared=record, image_embeds=embeds, extras=mine))
    return encoded


def _pinned(record, check, *args, **kwargs) -> None:
    """Run a per-image check; a failure names the record it belongs to, so the rest of the batch goes on."""
    try:
        check(*args, **kwargs)
    except CheckFailed as failure:
        failure.record = record
        raise


def non_finite_counts(outputs: dict[str, list[torch.Tensor]]) -> list[tuple[str, int]]:
    """(output name, NaN/Inf count) per output and image, counted on the device, read back in one sync."""
    names, counts = [], []
    for name, tensors in outputs.items():
        if tensors:
            rows = torch.cat([t.reshape(len(t), -1) for t in tensors])
            per_row = (~torch.isfinite(rows)).sum(-1)
            image = torch.repeat_interleave(torch.arange(len(tensors), device=rows.device),
                                            torch.tensor([len(t) for t in tensors], device=rows.device))
            counts.append(torch.zeros(len(tensors), dtype=per_row.dtype, device=rows.device).index_add_(0, image, per_row))
        names += [name] * len(tensors)
    values = torch.cat(counts).tolist() if counts else []
    return list(zip(names, values))


def to_host(tensors: list[torch.Tensor], dtype: torch.dtype | None) -> list[torch.Tensor]:
    """Per-image tensors copied to the host in one transfer (from pinned memory where it can overlap)."""
    if not tensors:
        return []
    joined = torch.cat(tensors)
    joined = joined.to(dtype) if dtype is not None else joined
    if joined.device.type == "cuda":
        host = torch.empty(joined.shape, dtype=joined.dtype, pin_memory=True)
        host.copy_(joined, non_blocking=True)
        torch.cuda.current_stream(joined.device).synchronize()
        joined = host
    return list(joined.split([len(t) for t in tensors]))


def check_shape(name: str, index: int, plan: ImagePlan, embed: torch.Tensor, hidden_size: int) -> None:
    shape = (expected_rows(name, plan), hidden_size)
    require(tuple(embed.shape) == shape, "encode.output_tokens",
            f"image {index}: the tower produced {name} of shape {tuple(embed.shape)}, the plan expects {shape}",
            expected=shape, observed=tuple(embed.shape), image_index=index)
