"""Assemble: one output row per record, in the columns the output contract declares (format.schema)."""

from __future__ import annotations

import numpy as np
import torch

from batchvlm.checks import require
from batchvlm.format.schema import EXTRA_OUTPUTS, IMAGE, VIDEO, stored_sizes
from batchvlm.format.strings import escaped_value, unencodable_fields
from batchvlm.records import ChatLayout, EncodedRecord, QuarantinedRecord, SourceRecord, TokenLayout, clip_parts


def embed_bytes(embeds: list[torch.Tensor], dtype: torch.dtype, hidden_size: int) -> bytes:
    """The tokens of all images in span order, as raw little-endian bytes of `dtype`."""
    if not embeds:
        return b""
    joined = torch.cat(embeds).to(device="cpu", dtype=dtype).contiguous()
    data = joined.view(torch.uint8).numpy().tobytes()
    expected = joined.shape[0] * hidden_size * joined.element_size()
    require(len(data) == expected, "assemble.embed_bytes", "embedding bytes do not match n_tokens x hidden x dtype",
            expected=expected, observed=len(data))
    return data


def checked_chat(layout: TokenLayout, train_on: str | None) -> ChatLayout | None:
    """assemble.loss_mask: a conversation's mask covers the sequence, lies on no image token, and (but for train_on=all)
    only on the tokens of assistant turns."""
    chat = layout.chat
    if chat is None:
        return None
    mask = np.asarray(chat.loss_mask, dtype=bool)
    require(len(mask) == len(layout.input_ids), "assemble.loss_mask", "the loss mask must cover the full sequence",
            expected=len(layout.input_ids), observed=len(mask))
    tags = np.asarray(layout.token_tags)
    on_images = int((mask & ((tags == IMAGE) | (tags == VIDEO))).sum())
    require(on_images == 0, "assemble.loss_mask", f"{on_images} image or video token(s) are trained", expected=0,
            observed=on_images)
    if train_on != "all":
        assistant = np.zeros(len(mask), dtype=bool)
        for turn in chat.turns:
            assistant[turn.start:turn.end] |= turn.role == "assistant"
        outside = int((mask & ~assistant).sum())
        require(outside == 0, "assemble.loss_mask", f"{outside} trained token(s) lie outside every assistant turn",
                expected=0, observed=outside)
    return chat


def data_row(encoded: EncodedRecord, dtype: torch.dtype, hidden_sizes: dict[str, int],
             train_on: str | None = None) -> dict:
    record = encoded.prepared
    layout = record.layout
    require(len(layout.token_tags) == len(layout.input_ids), "assemble.token_tags",
            "token_tags must cover the full sequence", expected=len(layout.input_ids),
            observed=len(layout.token_tags))
    chat = checked_chat(layout, train_on)
    plans = record.plans
    return {
        "id": record.source.id,
        "source": record.source.source,
        "row": record.source.row,
        "text": record.source.text,
        "input_ids": layout.input_ids,
        "image_spans": [{"start": start, "length": length} for start, length in layout.image_spans],
        "token_tags": layout.token_tags,
        "num_tokens": len(layout.input_ids),
        "loss_mask": chat.loss_mask if chat else None,
        "turns": [{"role": t.role, "start": t.start, "end": t.end} for t in chat.turns] if chat else None,
        "dropped_turns": chat.dropped_turns if chat else None,
        "grid_thw": [list(plan.grid_thw) for plan in plans],
        "original_size": [list(plan.original) for plan in plans],
        "resized_size": [list(plan.resized) for plan in plans],
        "image_sha256": [image.sha256 for image in record.images],
        "image_num_tokens": [plan.num_tokens for plan in plans],
        "num_image_tokens": sum(plan.num_tokens for plan in plans),
        "image_embeds": embed_bytes(encoded.image_embeds, dtype, hidden_sizes["image_embeds"]),
        **{name: embed_bytes(encoded.extras[name], dtype, stored_sizes(hidden_sizes)[name])
           if name in encoded.extras else None for name in EXTRA_OUTPUTS},
        "position_ids": layout.position_ids.tolist() if layout.position_ids is not None else None,
        "rope_delta": layout.rope_delta,
        **(clip_columns(encoded, dtype, hidden_sizes["image_embeds"]) if record.clips else NO_CLIPS),
    }


NO_CLIPS = dict.fromkeys(("video_spans", "video_grid_thw", "second_per_grid_ts", "video_num_tokens",
                          "video_frame_indices", "video_frame_times", "video_embeds"))


def clip_columns(encoded: EncodedRecord, dtype: torch.dtype, hidden_size: int) -> dict:
    """A record's clips' columns: their spans, grids, time steps, sampled frames and tokens."""
    record = encoded.prepared
    parts = clip_parts(record.clip_plans)  # a span, grid and tokens each (a Kimi-K2.5 clip's: per chunk)
    seconds = [getattr(plan, "second_per_grid_t", None) for plan in record.clip_plans]
    return {
        "video_spans": [{"start": start, "length": length} for start, length in record.layout.video_spans],
        "video_grid_thw": [list(part.grid_thw) for part in parts],
        "second_per_grid_ts": seconds if None not in seconds else None,  # Qwen's; a chunk's time is in its prompt
        "video_num_tokens": [part.num_tokens for part in parts],
        "video_frame_indices": [list(clip.indices) for clip in record.clips],
        "video_frame_times": [list(clip.timestamps_s) for clip in record.clips],
        "video_embeds": embed_bytes(encoded.video_embeds, dtype, hidden_size),
    }


def quarantine_row(item: QuarantinedRecord, bytes_cap: int, fingerprint: str, placeholder: str = "<image>") -> dict:
    """The record's row in its unit's quarantine shard: whatever it held, the strings UTF-8 cannot encode stored with
    backslash escapes (format.strings), the message saying which fields."""
    source: SourceRecord = item.source
    failure = item.failure
    row = {
        "id": source.id,
        "source": source.source,
        "row": source.row,
        "unit": source.unit_id,
        "stage": failure.stage,
        "check": failure.check,
        "message": failure.message,
        "expected": failure.expected,
        "observed": failure.observed,
        "exception_type": failure.exception_type,
        "image_index": failure.image_index,
        "video_index": failure.video_index,
        "image_bytes": [ref.data if ref.data is not None and len(ref.data) <= bytes_cap else None
                        for ref in source.images],
        "image_paths": [ref.path for ref in source.images],
        "video_paths": [ref.path for ref in source.videos] if source.videos else None,
        "text": source.text,
        "turns": [{"role": turn.role, "text": turn.text(placeholder)} for turn in source.turns]
        if source.turns is not None else None,
        "turn_index": failure.turn_index,
        "fingerprint": fingerprint,
    }
    unencodable = unencodable_fields(row)
    if unencodable:
        row = {name: escaped_value(value) if name in unencodable else value for name, value in row.items()}
        row["message"] += f" (stored escaped: {', '.join(unencodable)})"
    return row
