"""Encode: the family's tower on a packed batch (varlen, no padding), split back per image and checked."""

from __future__ import annotations

import torch

from batchvlm.checks import CheckFailed, require
from batchvlm.records import EncodedRecord, PackedBatch


def cu_seqlens_of(grid_thw: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(grid_thw.prod(-1).cumsum(0), (1, 0)).to(torch.int32)


def check_packing(batch: PackedBatch) -> None:
    rows = int(batch.pixel_values.shape[0])
    cu = cu_seqlens_of(batch.grid_thw)
    total = int(batch.grid_thw.prod(-1).sum())
    require(rows == total, "encode.packed_tokens", "packed rows do not match the grids of the batch",
            expected=total, observed=rows)
    require(int(cu[0]) == 0 and bool((cu[1:] > cu[:-1]).all()) and int(cu[-1]) == rows, "encode.packed_tokens",
            "cu_seqlens must start at 0, increase strictly and end at the packed row count",
            expected=f"0 .. {rows}, increasing", observed=cu.tolist())


def encode_batch(encoder, batch: PackedBatch) -> list[EncodedRecord]:
    check_packing(batch)
    outputs = encoder(batch.pixel_values, batch.grid_thw)
    encoded, cursor = [], 0
    for record in batch.records:
        embeds = outputs[cursor:cursor + len(record.plans)]
        cursor += len(record.plans)
        try:
            check_outputs(record.plans, embeds, encoder.hidden_size)
        except CheckFailed as failure:
            failure.record = record
            raise
        encoded.append(EncodedRecord(prepared=record, image_embeds=embeds))
    require(cursor == len(outputs), "encode.output_tokens", "the tower returned a different number of images",
            expected=cursor, observed=len(outputs))
    return encoded


def check_outputs(plans, embeds: list[torch.Tensor], hidden_size: int) -> None:
    require(len(embeds) == len(plans), "encode.output_tokens", "the tower returned a different number of images",
            expected=len(plans), observed=len(embeds))
    for index, (plan, embed) in enumerate(zip(plans, embeds)):
        require(tuple(embed.shape) == (plan.num_tokens, hidden_size), "encode.output_tokens",
                f"image {index}: the tower produced {tuple(embed.shape)}, the plan expects "
                f"({plan.num_tokens}, {hidden_size})", expected=(plan.num_tokens, hidden_size),
                observed=tuple(embed.shape), image_index=index)
        finite = torch.isfinite(embed)
        require(bool(finite.all()), "encode.finite", f"image {index}: {int((~finite).sum())} NaN/Inf values",
                expected="all finite", observed=f"{int((~finite).sum())} non-finite", image_index=index)
