"""Serving from stored features: each engine's request for a record of a run, the vision tower never run there.

What the engines take (read in their code; docs/training.md names the versions):
- vLLM (`LLM(..., enable_mm_embeds=True)`), Qwen2/2.5/3-VL: `multi_modal_data={"image": {"image_embeds": [n_tokens,
  hidden], "image_grid_thw": [n_images, 3]}}`. It splits the rows per image by `prod(grid) // merge_size**2` (its
  `_create_qwen2vl_field_factory` and `_process_image_input`) and expands each image placeholder of a token prompt
  into that many image tokens itself, so the prompt carries one placeholder per image. Qwen3-VL's rows are the
  merger's tokens and then the deepstack levels, side by side on the last dimension in level order
  (`[n_tokens, hidden * (1 + levels)]`, what its vision tower returns and `_compute_deepstack_embeds` splits).
  vLLM's Kimi-K2.5 takes pixels only: refused.
- sglang, Qwen2/2.5/3-VL: an `image_data` item `{"format": "precomputed_embedding", "feature": [n_tokens, hidden],
  "image_grid_thw": [n_images, 3]}` beside the expanded `input_ids`: it finds each image as a run of image tokens and
  keeps every other key as the item's model data. Qwen3-VL's feature is laid out as vLLM's
  (`separate_deepstack_embeds` splits it at the language model's hidden size). sglang's Kimi-K2.5 is refused: its
  token-id prompts go to `process_kimi_token_ids_mm_data`, which wants one `<|media_pad|>` per image and sizes each
  from the image itself (its `media_tokens_calculator`), so a precomputed item cannot go with them; and a prompt as
  text is re-tokenized there, which sglang's own tests show does not give Kimi's ids back.

Clips (Qwen2/2.5-VL runs), vLLM: `multi_modal_data["video"] = {"video_embeds": [n_video_tokens, hidden],
"video_grid_thw": [n_clips, 3], "second_per_grid_ts": [n_clips]}` (the last where the run stores it: Qwen2.5-VL's
M-RoPE time step, a `batched("video")` field of its processor). vLLM splits the rows per clip by
`prod(grid) // merge_size**2`, as for images, and expands each `<|video_pad|>` placeholder of a token prompt into that
many video tokens, so the prompt carries one placeholder per clip. sglang: its precomputed-embedding item is read here
for images only (the video form was not found clear in its code), so a record with clips is refused for sglang,
naming it. A record with clips whose run lacks their grids (a format-2 run upgraded) is refused too.

Every tensor keeps the stored dtype (the engines cast to their tower's); grids are int64. A record is checked before
its request is built: the engine's split of its rows must give exactly its stored image spans.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow.parquet as pq
import torch

from batchvlm.training.reader import RecordTensors, Runs, TrustedShard, read_shard, trusted_shards

VLLM, SGLANG = "vllm", "sglang"
FAMILIES = {VLLM: ("qwen2_vl",), SGLANG: ("qwen2_vl",)}
"""The batchvlm families whose stored rows each engine takes as embeddings (qwen2_vl covers Qwen2, 2.5 and 3-VL)."""
WHY_NOT = {(VLLM, "kimi_k25"): "vLLM's Kimi-K2.5 takes pixel_values and grid_thws only (no embedding input)",
           (SGLANG, "kimi_k25"): "sglang's Kimi-K2.5 sizes every image of a token-id prompt from the image itself "
                                 "(process_kimi_token_ids_mm_data), so a precomputed embedding cannot go with the "
                                 "stored input_ids, and re-tokenizing them as text does not give them back",
           (VLLM, "siglip2"): "SigLIP2 rows are patch tokens before a projector no engine runs on them",
           (SGLANG, "siglip2"): "SigLIP2 rows are patch tokens before a projector no engine runs on them"}


@dataclass(frozen=True)
class ServedRun:
    """What an engine's request depends on beyond a record: the engine, and the family that wrote the run."""
    engine: str
    family: str
    merge_size: int = 2

    def __post_init__(self):
        if not isinstance(self.merge_size, int) or isinstance(self.merge_size, bool) or self.merge_size < 1:
            raise ValueError(f"merge_size={self.merge_size!r} must be a positive integer (the checkpoint's "
                             "spatial merge: 2 for Qwen2/2.5/3-VL)")
        if self.engine not in FAMILIES:
            raise ValueError(f"engine={self.engine!r}: one of {sorted(FAMILIES)}")
        if self.family not in FAMILIES[self.engine]:
            why = WHY_NOT.get((self.engine, self.family), "it has no embedding input for this family")
            raise ValueError(f"{self.engine} cannot serve the stored rows of the {self.family!r} family: {why}; it takes "
                             f"those of {list(FAMILIES[self.engine])}")


def served_run(runs: Runs, engine: str, merge_size: int = 2) -> ServedRun:
    """The run's family as its shards record it, checked for `engine`; rows stored before the projector (a run with
    `model.embedding=tower`) are refused: no engine takes them."""
    return served_shards(runs, trusted_shards(runs), engine, merge_size)


def served_shards(runs: Runs, shards: list[TrustedShard], engine: str, merge_size: int) -> ServedRun:
    """`served_run` of the run's shards, listed and checked already."""
    if not shards:
        raise ValueError(f"{runs} has no committed shards")
    metadata = pq.read_schema(shards[0].path).metadata
    embedding = metadata[b"batchvlm.embedding"].decode()
    if embedding == "tower":
        raise ValueError(f"{runs}: its image_embeds are the tower's tokens before the projector (model.embedding=tower);"
                         " an engine takes the projector's output (model.embedding=projector or both)")
    return ServedRun(engine, metadata[b"batchvlm.family"].decode(), merge_size)


def engine_embeds(record: RecordTensors) -> torch.Tensor:
    """The rows an engine takes: image_embeds, and for Qwen3-VL its deepstack levels beside them on the last dim (the
    stored deepstack_embeds hold the levels side by side already, in level order)."""
    deepstack = record.extras.get("deepstack_embeds")
    return record.image_embeds if deepstack is None else torch.cat([record.image_embeds, deepstack], dim=-1)


def checked_split(record: RecordTensors, merge_size: int) -> None:
    """The engines' split, `prod(grid) // merge_size**2` rows per image, must be the record's image spans."""
    checked_rows(record.id, "image", record.grid_thw, record.image_spans, record.image_embeds, merge_size)


def checked_rows(record_id: str, kind: str, grids: torch.Tensor, spans: torch.Tensor, rows: torch.Tensor,
                 merge_size: int) -> None:
    """An engine's split of a record's `rows`, `prod(grid) // merge_size**2` per image or clip (`kind`), must give
    exactly its stored `spans`."""
    per_item = (grids.prod(-1) // merge_size ** 2).tolist()
    stored = spans[:, 1].tolist()
    if per_item != stored or sum(stored) != len(rows):
        raise ValueError(f"record {record_id}: {kind} grids give {per_item} tokens per {kind}, its spans {stored} and "
                         f"{len(rows)} {kind} rows; merge_size={merge_size} is not its checkpoint's")


def vllm_image_input(record: RecordTensors, merge_size: int = 2) -> dict[str, torch.Tensor]:
    """vLLM's `multi_modal_data["image"]` for the record's images (Qwen2/2.5/3-VL)."""
    checked_split(record, merge_size)
    return {"image_embeds": engine_embeds(record), "image_grid_thw": record.grid_thw}


def sglang_image_item(record: RecordTensors, merge_size: int = 2) -> dict:
    """sglang's precomputed-embedding `image_data` item for the record's images (Qwen2/2.5/3-VL)."""
    checked_split(record, merge_size)
    return {"format": "precomputed_embedding", "feature": engine_embeds(record), "image_grid_thw": record.grid_thw}


def has_clips(record: RecordTensors) -> bool:
    return record.video_spans is not None and len(record.video_spans) > 0


def checked_clip_split(record: RecordTensors, merge_size: int) -> None:
    """vLLM's split of video_embeds, `prod(grid) // merge_size**2` rows per clip, must be the record's clip spans."""
    if record.video_grid_thw is None or len(record.video_grid_thw) != len(record.video_spans):
        raise ValueError(f"record {record.id!r} holds {len(record.video_spans)} clip(s) but its run stores no "
                         "video_grid_thw for them (a format-2 run upgraded): vLLM's video_embeds input needs each "
                         "clip's grid")
    checked_rows(record.id, "clip", record.video_grid_thw, record.video_spans, record.video_embeds, merge_size)


def vllm_video_input(record: RecordTensors, merge_size: int = 2) -> dict[str, torch.Tensor]:
    """vLLM's `multi_modal_data["video"]` for the record's clips (Qwen2/2.5-VL); `second_per_grid_ts` where stored."""
    checked_clip_split(record, merge_size)
    video = {"video_embeds": record.video_embeds, "video_grid_thw": record.video_grid_thw}
    if record.second_per_grid_ts is not None:
        video["second_per_grid_ts"] = record.second_per_grid_ts
    return video


def one_placeholder_per_item(record: RecordTensors) -> list[int]:
    """The record's input_ids with each image's span of image tokens, and each clip's of video tokens, reduced to its
    first: the prompt vLLM expands."""
    keep = torch.ones(len(record.input_ids), dtype=torch.bool)
    spans = record.image_spans.tolist() + (record.video_spans.tolist() if has_clips(record) else [])
    for start, length in spans:
        keep[start + 1:start + length] = False
    return record.input_ids[keep].tolist()


def refuse_clips_for_sglang(record: RecordTensors) -> None:
    """sglang's video input for stored rows is not built (module docstring): a record with clips is refused by id."""
    if has_clips(record):
        raise ValueError(f"record {record.id!r} holds {len(record.video_spans)} clip(s) ({len(record.video_embeds)} "
                         "video_embeds rows at its <|video_pad|> tokens): the sglang request is built for images "
                         "only, so it would lack the clips' video_embeds, video_grid_thw and second_per_grid_ts; "
                         "serve it with vLLM, or serve the run's records without clips with sglang")


def request(record: RecordTensors, served: ServedRun) -> dict:
    """The engine's request for one record: `LLM.generate(request)` for vLLM, `Engine.generate(**request)` for
    sglang. A record without images or clips is a plain token prompt; sglang refuses clips (refuse_clips_for_sglang)."""
    has_images = len(record.grid_thw) > 0
    if served.engine == VLLM:
        prompt = {"prompt_token_ids": one_placeholder_per_item(record)}
        media = {}
        if has_images:
            media["image"] = vllm_image_input(record, served.merge_size)
        if has_clips(record):
            media["video"] = vllm_video_input(record, served.merge_size)
        if media:
            prompt["multi_modal_data"] = media
        return prompt
    refuse_clips_for_sglang(record)
    prompt = {"input_ids": record.input_ids.tolist()}
    if has_images:
        prompt["image_data"] = [sglang_image_item(record, served.merge_size)]
    return prompt


def serving_requests(runs: Runs, engine: str, merge_size: int = 2) -> Iterator[tuple[str, dict]]:
    """(record id, the engine's request) for every record of a finished run, in `read_run`'s order."""
    shards = trusted_shards(runs)  # listed and checked once, for the family and for the records (read_run's order)
    served = served_shards(runs, shards, engine, merge_size)
    for shard in shards:
        for record in read_shard(shard.path, shard.skipped):
            yield record.id, request(record, served)
