"""Encode: the family's tower on a packed batch (varlen, no padding), split back per image and checked."""

from __future__ import annotations

import torch

from batchvlm.checks import CheckFailed, require
from batchvlm.records import EncodedRecord, ImagePlan, PackedBatch

EXTRA_OUTPUTS = {
    "tower_embeds": "the tower's features before the projector, grouped per LLM token (model.embedding=both)",
    "pooled_embeds": "one pooled vector per image (SigLIP2's attention-pooling head)",
    "deepstack_embeds": "Qwen3-VL deepstack features per LLM token, the layers concatenated along hidden",
}
"""Outputs an encoder may return beside `image_embeds`; each is stored in its own column."""


def expected_rows(name: str, plan: ImagePlan) -> int:
    return 1 if name == "pooled_embeds" else plan.num_tokens


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
    outputs = encoder(batch.pixel_values, batch.grid_thw)  # {output name: one tensor per image}
    encoded, cursor = [], 0
    for record in batch.records:
        mine = {name: tensors[cursor:cursor + len(record.plans)] for name, tensors in outputs.items()}
        cursor += len(record.plans)
        try:
            for name, tensors in mine.items():
                check_outputs(name, record.plans, tensors, encoder.hidden_sizes[name])
        except CheckFailed as failure:
            failure.record = record
            raise
        embeds = mine.pop("image_embeds")
        encoded.append(EncodedRecord(prepared=record, image_embeds=embeds, extras=mine))
    for name, tensors in outputs.items():
        require(cursor == len(tensors), "encode.output_tokens", f"the tower returned {name} for a different number "
                "of images", expected=cursor, observed=len(tensors))
    return encoded


def check_outputs(name: str, plans: list[ImagePlan], embeds: list[torch.Tensor], hidden_size: int) -> None:
    require(len(embeds) == len(plans), "encode.output_tokens", f"the tower returned {name} for a different number "
            "of images", expected=len(plans), observed=len(embeds))
    for index, (plan, embed) in enumerate(zip(plans, embeds)):
        shape = (expected_rows(name, plan), hidden_size)
        require(tuple(embed.shape) == shape, "encode.output_tokens",
                f"image {index}: the tower produced {name} of shape {tuple(embed.shape)}, the plan expects {shape}",
                expected=shape, observed=tuple(embed.shape), image_index=index)
        finite = torch.isfinite(embed)
        require(bool(finite.all()), "encode.finite", f"image {index}: {int((~finite).sum())} NaN/Inf values in "
                f"{name}", expected="all finite", observed=f"{int((~finite).sum())} non-finite", image_index=index)
