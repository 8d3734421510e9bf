"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL: Qwen2-VL (arXiv 2409.12191), Qwen2.5-VL (arXiv 2502.13923),
github.com/QwenLM/Qwen2.5-VL and Qwen3-VL, transformers' qwen2_vl, qwen2_5_vl and qwen3_vl models and processors.

The three generations differ only in parameters read from the checkpoint: patch size (14, 14, 16),
normalization (CLIP, CLIP, 0.5), window attention (2.5, inside the tower) and deepstack features
(3). Resize: `smart_resize` to multiples of p*m within [min_pixels, max_pixels]; a still image is one
frame repeated temporal_patch_size times; rows in merge-window order (layouts.MERGE_WINDOW). Prompt:
`<|vision_start|>` + `<|image_pad|>` * (h*w/m^2) + `<|vision_end|>`, with M-RoPE positions per token.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from batchvlm.checks import require
from batchvlm.config import ConfigError
from batchvlm.families import ModelConfig
from batchvlm.devices import to_device
from batchvlm.families.checkpoint import Layout, Rename, nontrivial, write_released
from batchvlm.families.common import (PatchFamily, checkpoint_and_tokenizer, config_field, processor_params,
                                      optional_token_id, published_template, read_config, tiny_tokenizer, token_id,
                                      tokenizer_digest,
                                      tower_inputs)
from batchvlm.towers.attention import resolve_attention, use
from batchvlm.towers.grids import PerGrid, interpolation_taps, joined, patches_of
from batchvlm.format.layouts import MERGE_WINDOW, PatchLayout
from batchvlm.records import ImagePlan, TokenLayout
from batchvlm.format.schema import FRAME, IMAGE, VIDEO

IMAGE_TOKEN = "<|image_pad|>"
VIDEO_TOKEN = "<|video_pad|>"
FRAME_TOKENS = ("<|vision_start|>", "<|vision_end|>")
MAX_ASPECT_RATIO = 200

VERSIONS = {
    # model_type: (modeling module, vision tower class)
    "qwen2_vl": ("transformers.models.qwen2_vl.modeling_qwen2_vl", "Qwen2VisionTransformerPretrainedModel"),
    "qwen2_5_vl": ("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl", "Qwen2_5_VisionTransformerPretrainedModel"),
    "qwen3_vl": ("transformers.models.qwen3_vl.modeling_qwen3_vl", "Qwen3VLVisionModel"),
}


@dataclass(frozen=True)
class QwenProcessorParams:
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
    image_std: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)

    @classmethod
    def from_checkpoint(cls, path: Path, overrides: dict) -> "QwenProcessorParams":
        params = processor_params(cls, _read_processor_config(path), overrides, "qwen2_vl")
        if params.min_pixels > params.max_pixels:
            raise ConfigError(f"model.processor: min_pixels={params.min_pixels} > max_pixels={params.max_pixels}")
        if params.min_pixels < params.factor ** 2:  # below one merge window an image plans to a 0x0 grid
            raise ConfigError(f"model.processor.min_pixels={params.min_pixels} must be >= (patch_size*merge_size)^2 "
                              f"= {params.factor ** 2}")
        return params

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


def _read_processor_config(path: Path) -> dict:
    file = path / "preprocessor_config.json"
    if not file.exists():
        return {}
    raw = json.loads(file.read_text())
    keys = ("patch_size", "merge_size", "temporal_patch_size", "min_pixels", "max_pixels", "image_mean", "image_std")
    values = {k: raw[k] for k in keys if raw.get(k) is not None}
    # In the HF size dict, shortest_edge is min_pixels and longest_edge is max_pixels (areas, not edges).
    size = raw.get("size") or {}
    if "shortest_edge" in size:
        values.setdefault("min_pixels", size["shortest_edge"])
    if "longest_edge" in size:
        values.setdefault("max_pixels", size["longest_edge"])
    return values


def smart_resize(height: int, width: int, params: QwenProcessorParams, frames: int = 1,
                 t_bar: int = 1) -> tuple[int, int]:
    """The processor's rule, pinned to transformers 5.24: half-even rounding, max(factor, .) only when shrinking. A
    Qwen3-VL clip is held whole (qwen3_smart_resize): its `frames`, `t_bar` of them in whole temporal patches."""
    factor = params.factor
    ratio = max(height, width) / min(height, width)
    require(ratio <= MAX_ASPECT_RATIO, "plan.size_rule", f"aspect ratio {ratio:.1f} is over the "
            f"{MAX_ASPECT_RATIO} that Qwen's processor accepts", expected=f"<= {MAX_ASPECT_RATIO}",
            observed=f"{ratio:.1f} ({width}x{height})")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if t_bar * h_bar * w_bar > params.max_pixels:
        beta = math.sqrt(frames * height * width / params.max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < params.min_pixels:
        beta = math.sqrt(params.min_pixels / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def qwen_plan(height: int, width: int, params: QwenProcessorParams) -> ImagePlan:
    resized = smart_resize(height, width, params)
    p, m = params.patch_size, params.merge_size
    grid = (1, resized[0] // p, resized[1] // p)  # t = 1 frame / temporal_patch_size, rounded up
    return ImagePlan(original=(height, width), resized=resized, padded=resized, grid_thw=grid,
                     num_tokens=grid[1] * grid[2] // (m * m))


VIDEO_PROCESSOR_CONFIG = "video_preprocessor_config.json"

VIDEO_RULE = "transformers Qwen2VLVideoProcessor: do_sample_frames=True, cap_pixels_per_frame=True"
"""The one reference batchvlm samples and sizes Qwen2/2.5-VL clips by (qwen-vl-utils samples `linspace(...).round()`
instead of `floor(i * total / n)`: other frames, same count, same sizes)."""


@dataclass(frozen=True)
class QwenVideoParams:
    """A clip's sampling and pixel budget, as transformers' Qwen2VLVideoProcessor defaults them."""

    fps: float = 2.0
    """Frames sampled per second of the clip, before the clamp."""
    min_frames: int = 4
    max_frames: int = 768
    min_pixels: int = 128 * 28 * 28
    """Per frame (the processor's size.shortest_edge)."""
    max_pixels: int = 768 * 28 * 28
    """Per frame (size.longest_edge), before the share of the per-video budget."""
    max_video_tokens: int = 128_000
    """The per-video budget: 90% of this many tokens' pixels, shared evenly by the sampled frames."""

    def __post_init__(self) -> None:
        if not (self.fps > 0 and 0 < self.min_frames <= self.max_frames and 0 < self.min_pixels <= self.max_pixels):
            raise ConfigError(f"model.video: fps > 0, 0 < min_frames <= max_frames and 0 < min_pixels <= max_pixels "
                              f"must hold: {self}")

    @classmethod
    def from_checkpoint(cls, path: Path) -> "QwenVideoParams":
        """As transformers' AutoVideoProcessor reads a checkpoint: its video processor config, or where it ships none
        (a released Qwen2-VL), its image processor's pixel sizes; what neither states, at the video processor's
        defaults."""
        file = next((path / name for name in (VIDEO_PROCESSOR_CONFIG, "preprocessor_config.json")
                     if (path / name).exists()), None)
        raw = json.loads(file.read_text()) if file is not None else {}
        size = raw.get("size") or {}
        values = {"min_pixels": size.get("shortest_edge", raw.get("min_pixels")),
                  "max_pixels": size.get("longest_edge", raw.get("max_pixels"))}
        values |= {key: raw.get(key) for key in ("fps", "min_frames", "max_frames", "max_video_tokens")}
        return cls(**{key: value for key, value in values.items() if value is not None})


@dataclass(frozen=True)
class VideoPlan:
    indices: tuple[int, ...]
    """The sampled frames, in presentation order."""
    resized: tuple[int, int]
    grid_thw: tuple[int, int, int]
    num_tokens: int
    sampled_fps: float
    """Frames sampled per second of the clip: what the temporal patches' times come from, not the configured fps."""
    second_per_grid_t: float
    """Seconds one temporal patch spans (Qwen2.5-VL's second_per_grid_ts): temporal_patch_size / sampled_fps."""
    timestamps: tuple[float, ...] | None = None
    """Qwen3-VL: each temporal patch's time in seconds (the mean of its frames' pts times), written before its span;
    None where the clip is one span (Qwen2/2.5-VL)."""

    @property
    def num_patches(self) -> int:
        return math.prod(self.grid_thw)

    @property
    def spans(self) -> list["VideoPlan"]:
        """The spans the clip lays out in the ids, in order, each with its own grid: the clip itself (Qwen2/2.5-VL),
        or one (1, h, w) span per temporal patch (Qwen3-VL), positioned as a still image is."""
        if self.timestamps is None:
            return [self]
        t, h, w = self.grid_thw
        one = dataclasses.replace(self, grid_thw=(1, h, w), num_tokens=self.num_tokens // t, timestamps=None)
        return [one] * t


def qwen_sample_frames(total: int, video_fps: float, params: QwenProcessorParams, video: QwenVideoParams) -> list[int]:
    """video.fps frames per second of the clip, clamped to [min_frames, max_frames] and the clip's frames, floored to
    whole temporal patches; frame i at floor(i * total / n)."""
    tps = params.temporal_patch_size
    most = min(video.max_frames, total) // tps * tps
    wanted = min(max(total / video_fps * video.fps, video.min_frames), most, total)
    count = math.floor(wanted / tps) * tps
    require(count >= tps, "video.too_few_frames", f"the clip has {total} frames, fewer than one temporal patch "
            f"({tps} frames) once sampled", expected=f">= {tps} frames", observed=f"{total} frames")
    return [i * total // count for i in range(count)]


def qwen_video_plan(indices: list[int], total: int, video_fps: float, height: int, width: int,
                    params: QwenProcessorParams, video: QwenVideoParams) -> VideoPlan:
    """Each sampled frame resized alike: smart_resize between min_pixels and the per-frame cap, the cap being the
    smaller of max_pixels and the frame's even share of the per-video budget (never below 1.05 x min_pixels)."""
    count, tps, p, m = len(indices), params.temporal_patch_size, params.patch_size, params.merge_size
    budget = int(video.max_video_tokens * params.factor ** 2 * 0.9)
    cap = max(min(video.max_pixels, budget * tps // count), int(video.min_pixels * 1.05))
    resized = smart_resize(height, width, dataclasses.replace(params, min_pixels=video.min_pixels, max_pixels=cap))
    grid = (-(-count // tps), resized[0] // p, resized[1] // p)  # an odd count repeats its last frame
    sampled_fps = count / total * video_fps
    return VideoPlan(indices=tuple(indices), resized=resized, grid_thw=grid, num_tokens=math.prod(grid) // (m * m),
                     sampled_fps=sampled_fps, second_per_grid_t=tps / sampled_fps)


QWEN3_VIDEO_RULE = ("transformers Qwen3VLVideoProcessor: do_sample_frames=True, cap_pixels_per_frame=True; "
                    "Qwen3VLProcessor's `<t seconds>` per temporal patch, t from the frames' pts")
"""The one reference batchvlm samples, sizes and prompts Qwen3-VL clips by. qwen-vl-utils (the authors' own) differs in
size: it holds each frame, not the whole clip, to the minimum (a 96x64 clip of 6 frames: grid [3, 8, 12] here, [3, 20,
28] there); batchvlm follows the processor transformers' Qwen3VLProcessor and the trainers built on it run, the one a
stored row is checked against."""


@dataclass(frozen=True)
class Qwen3VideoParams(QwenVideoParams):
    """A Qwen3-VL clip's sampling and pixel budget, as transformers' Qwen3VLVideoProcessor defaults them. Its sizes
    are the whole clip's: min_pixels bounds the sampled frames' pixels together (frames x height x width), and each
    frame gets max(min(max_video_tokens tokens' pixels, max_pixels / frames), 1.05 x min_pixels)."""

    min_pixels: int = 128 * 32 * 32
    max_pixels: int = 768 * 32 * 32
    max_video_tokens: int = 768
    """Per frame (qwen-vl-utils' VIDEO_MAX_TOKEN_NUM)."""


def qwen3_sample_frames(total: int, video_fps: float, params: QwenProcessorParams,
                        video: QwenVideoParams) -> list[int]:
    """video.fps frames per second of the clip (truncated), clamped to [min_frames, max_frames] and the clip's frames;
    frame i at linspace(0, total - 1, n).round() (half to even). An odd count is padded in the rows, not here."""
    tps = params.temporal_patch_size
    count = min(max(int(total / video_fps * video.fps), video.min_frames), video.max_frames, total)
    require(count >= tps, "video.too_few_frames", f"the clip has {total} frames, fewer than one temporal patch "
            f"({tps} frames)", expected=f">= {tps} frames", observed=f"{total} frames")
    return np.linspace(0, total - 1, count).round().astype(np.int64).tolist()


def qwen3_smart_resize(frames: int, height: int, width: int, params: QwenProcessorParams, min_pixels: int,
                       max_pixels: int) -> tuple[int, int]:
    """Qwen3VLVideoProcessor's smart_resize: the clip's frames x height x width (frames rounded half to even to whole
    temporal patches) held within [min_pixels, max_pixels]; a frame under one factor scaled up first."""
    factor, tps = params.factor, params.temporal_patch_size
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    return smart_resize(height, width, dataclasses.replace(params, min_pixels=min_pixels, max_pixels=max_pixels),
                        frames=frames, t_bar=round(frames / tps) * tps)


def qwen3_video_plan(indices: list[int], times: list[float], total: int, video_fps: float, height: int, width: int,
                     params: QwenProcessorParams, video: QwenVideoParams) -> VideoPlan:
    """The clip sized as a whole (qwen3_smart_resize, the per-frame cap applied), its grid, and each temporal patch's
    time: the mean of its first and last frame's times (an odd count's last patch repeats its last frame)."""
    count, tps, p, m = len(indices), params.temporal_patch_size, params.patch_size, params.merge_size
    per_frame = max(min(video.max_video_tokens * params.factor ** 2, video.max_pixels // count),
                    int(video.min_pixels * 1.05))
    resized = qwen3_smart_resize(count, height, width, params, video.min_pixels, per_frame * count)
    grid = (-(-count // tps), resized[0] // p, resized[1] // p)
    padded = list(times) + [times[-1]] * (-count % tps)
    timestamps = tuple((padded[k] + padded[k + tps - 1]) / 2 for k in range(0, len(padded), tps))
    sampled_fps = count / total * video_fps
    return VideoPlan(indices=tuple(indices), resized=resized, grid_thw=grid, num_tokens=math.prod(grid) // (m * m),
                     sampled_fps=sampled_fps, second_per_grid_t=tps / sampled_fps, timestamps=timestamps)


def timestamp_text(seconds: float) -> str:
    """A Qwen3-VL temporal patch's time as its processor writes it: text the model reads, never a special token."""
    return f"<{seconds:.1f} seconds>"


def mrope_positions(seq_len: int, spans: list[tuple[int, int]], plans: list[ImagePlan | VideoPlan],
                    merge_size: int, time_steps: list[float] | None = None) -> tuple[np.ndarray, int]:
    """M-RoPE (3, seq) position ids and delta, as the model authors' `get_rope_index` computes them.

    Text advances all three axes by one per token; a span's tokens get (next + time, next + row, next + column) over
    its LLM grid, and the next text starts after the span's largest position. A still image has one time (0); a
    clip's temporal patch k has time int(k * step), its span's `time_steps` entry: 1 for Qwen2-VL, tokens_per_second *
    second_per_grid_t for Qwen2.5-VL (float32, as the authors' code multiplies it).
    """
    pieces, next_pos, cursor = [], 0, 0
    for index, ((start, length), plan) in enumerate(zip(spans, plans)):
        pieces.append(np.broadcast_to(np.arange(start - cursor) + next_pos, (3, start - cursor)))
        next_pos += start - cursor
        t, h, w = plan.grid_thw
        step = np.float32(1 if time_steps is None else time_steps[index])
        times = (np.arange(t, dtype=np.float32) * step).astype(np.int64)
        time, rows, cols = np.meshgrid(times, np.arange(h // merge_size), np.arange(w // merge_size), indexing="ij")
        vision = np.stack([time.ravel(), rows.ravel(), cols.ravel()]) + next_pos
        pieces.append(vision)
        next_pos = int(vision.max()) + 1
        cursor = start + length
    pieces.append(np.broadcast_to(np.arange(seq_len - cursor) + next_pos, (3, seq_len - cursor)))
    positions = np.concatenate(pieces, axis=1).astype(np.int64)
    return positions, int(positions.max(initial=-1)) + 1 - seq_len


class QwenEncoder(torch.nn.Module):
    """The vision tower with its merger: packed merge-window rows and grids in, per-image tokens out."""

    def __init__(self, tower: torch.nn.Module, embedding: str, merge_size: int, version: str, attention: str):
        super().__init__()
        self.tower = tower
        self.embedding = embedding
        self.version = version
        self.attention = use(tower, attention)
        self.merge_area = merge_size * merge_size
        merged = [m for m in tower.merger.modules() if isinstance(m, torch.nn.Linear)][-1].out_features
        tower_size = tower.patch_embed.proj.out_channels * self.merge_area
        self.hidden_sizes = {"image_embeds": tower_size if embedding == "tower" else merged}
        if embedding == "both":
            self.hidden_sizes["tower_embeds"] = tower_size
        self.deepstack_layers = len(getattr(tower.config, "deepstack_visual_indexes", None) or [])
        if self.deepstack_layers:
            self.hidden_sizes["deepstack_embeds"] = merged * self.deepstack_layers
        self.hidden_size = self.hidden_sizes["image_embeds"]
        self.per_grid = PerGrid(self.image_inputs)

    def inputs(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """The tower's inputs for a batch of the host grid `grid_thw` (common.tower_inputs): the rotary positions in
        merge-window order; Qwen2.5-VL's window order and window boundaries; Qwen3-VL's bilinear taps of its
        position table. Each image's part computed once per grid on the host (towers.grids), joined here."""
        from transformers.vision_utils import get_vision_cu_seqlens

        parts = self.per_grid(grid_thw)
        indices = {name: joined(parts, name) for name in parts[0] if name in ("position_ids", "interp_indices",
                                                                              "interp_weights")}
        boundaries = {"cu_seqlens": get_vision_cu_seqlens(grid_thw)}
        if self.version == "qwen2_5_vl":
            merged = [patches_of(grid) // self.merge_area for grid in map(tuple, grid_thw.tolist())]
            offsets = [sum(merged[:i]) for i in range(len(parts))]
            indices["window_index"] = torch.cat([part["window_index"] + offset
                                                 for part, offset in zip(parts, offsets)])
            boundaries["cu_window_seqlens"] = torch.cat(
                [torch.zeros(1, dtype=torch.int32)] + [part["cu_window_seqlens"][1:] + offset * self.merge_area
                                                       for part, offset in zip(parts, offsets)])
        return tower_inputs(self.tower, pixel_values, self.attention, indices, boundaries)

    def image_inputs(self, grid: tuple[int, int, int]) -> dict:
        """One image's part of `inputs`, by transformers' functions on its grid alone (the taps by towers.grids)."""
        from transformers.vision_utils import get_vision_position_ids, get_vision_window_index

        tower, one = self.tower, torch.tensor([grid])
        parts = {"position_ids": get_vision_position_ids(one, tower.spatial_merge_size)}
        if self.version == "qwen2_5_vl":
            parts["window_index"], parts["cu_window_seqlens"] = get_vision_window_index(
                one, tower.spatial_merge_size, tower.window_size, tower.patch_size)
        if self.version == "qwen3_vl":
            parts["interp_indices"], parts["interp_weights"] = interpolation_taps(
                grid, tower.num_grid_per_side, tower.interpolation_mode, tower.interpolation_align_corners,
                tower.config.spatial_merge_size)
        return parts

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> dict[str, list[torch.Tensor]]:
        """`grid_thw` on the host (the batch's planned grids), so that nothing here waits for the device."""
        pixel_values, kwargs = self.inputs(pixel_values, grid_thw)
        out = self.tower(pixel_values, grid_thw=to_device(grid_thw, pixel_values.device), **kwargs)
        sizes = (grid_thw.prod(-1) // self.merge_area).tolist()
        split = lambda tokens: list(torch.split(tokens, sizes))  # noqa: E731
        # The tower's features grouped per merge window: the m*m consecutive rows the merger concatenates.
        tower_tokens = out.last_hidden_state.reshape(-1, self.merge_area * out.last_hidden_state.shape[-1])
        outputs = {"image_embeds": split(tower_tokens if self.embedding == "tower" else out.pooler_output)}
        if self.embedding == "both":
            outputs["tower_embeds"] = split(tower_tokens)
        if self.deepstack_layers:
            outputs["deepstack_embeds"] = split(torch.cat(list(out.deepstack_features), dim=-1))
        return outputs


VIDEO_RULES = {"qwen2_vl": VIDEO_RULE, "qwen2_5_vl": VIDEO_RULE, "qwen3_vl": QWEN3_VIDEO_RULE}
"""Each version's clip rule. Qwen3-VL's differs from the others': its own sizing, a text timestamp and a span of its
own per temporal patch."""


class Qwen2VL(PatchFamily):
    name = "qwen2_vl"
    resample = "bicubic"
    frame_tokens = FRAME_TOKENS

    def __init__(self, checkpoint: Path, params: QwenProcessorParams, tokenizer, embedding: str,
                 attn_implementation: str):
        super().__init__(checkpoint, params, tokenizer, embedding, attn_implementation,
                         PatchLayout(MERGE_WINDOW, params.patch_size, params.merge_size, params.temporal_patch_size),
                         IMAGE_TOKEN)
        self.frame_ids = [token_id(tokenizer, token, self.name) for token in FRAME_TOKENS]
        raw = read_config(checkpoint)
        self.version = _model_type(checkpoint)
        self.video_token_id = _video_token_id(tokenizer, raw)
        self.tokens_per_second = _tokens_per_second(raw, checkpoint) if self.version == "qwen2_5_vl" else None
        self.video_params = (Qwen3VideoParams if self.version == "qwen3_vl" else QwenVideoParams).from_checkpoint(
            checkpoint)

    @property
    def video_rule(self) -> str | None:
        """The rule this checkpoint's clips are sampled, sized and laid out by; None where the tokenizer lacks the
        checkpoint's video token."""
        return VIDEO_RULES[self.version] if self.video_token_id is not None else None

    def video_sampler(self) -> functools.partial:
        """(frames in a clip, its fps) -> the frames sampled (pipeline.video.Sampler), picklable for the decoder's
        child."""
        sample = qwen3_sample_frames if self.version == "qwen3_vl" else qwen_sample_frames
        return functools.partial(sample, params=self.params, video=self.video_params)

    def plan_video(self, indices: list[int], total: int, video_fps: float, height: int, width: int,
                   times: list[float] | None = None) -> VideoPlan:
        """A clip's plan from its sampled frames, its header's frame count and rate, its frames' upright size (as
        decoded) and their times from the pts (Qwen3-VL's timestamps; without them, index / fps as its processor
        computes them)."""
        if self.version == "qwen3_vl":
            times = times if times is not None else [index / video_fps for index in indices]
            return qwen3_video_plan(indices, times, total, video_fps, height, width, self.params, self.video_params)
        return qwen_video_plan(indices, total, video_fps, height, width, self.params, self.video_params)

    def video_prompt(self, plan: VideoPlan) -> str | None:
        """Qwen3-VL: the text that stands for a clip where the chat template renders
        `<|vision_start|><|video_pad|><|vision_end|>`: each temporal patch's timestamp, then its own start, pad and
        end (its pad then expanded to the patch's tokens). None: the template's rendering stands (Qwen2/2.5-VL)."""
        if plan.timestamps is None:
            return None
        wrapped = FRAME_TOKENS[0] + VIDEO_TOKEN + FRAME_TOKENS[1]
        return "".join(timestamp_text(seconds) + wrapped for seconds in plan.timestamps)

    def expand_video(self, plan: VideoPlan) -> tuple[list[int], list[int]]:
        """The ids (and their tags) that replace one Qwen2/2.5-VL clip's `<|vision_start|><|video_pad|><|vision_end|>`
        (a Qwen3-VL clip's timestamps are tokenized with the text around them: the renderer's, from video_prompt)."""
        start, end = self.frame_ids
        count = plan.num_tokens
        return [start] + [self.video_token_id] * count + [end], [FRAME] + [VIDEO] * count + [FRAME]

    def time_step(self, plan: ImagePlan | VideoPlan) -> float:
        """How far a span's M-RoPE time moves per temporal patch: 1 for Qwen2-VL; for Qwen2.5-VL, the checkpoint's
        tokens_per_second times the seconds a temporal patch spans (a still image has one patch: any step)."""
        if isinstance(plan, VideoPlan) and self.version == "qwen2_5_vl":
            return self.tokens_per_second * plan.second_per_grid_t
        return 1.0

    def media_positions(self, seq_len: int, spans: list[tuple[int, int]],
                        plans: list[ImagePlan | VideoPlan]) -> tuple[np.ndarray, int]:
        """M-RoPE positions of a sequence whose spans (images and clips, in sequence order) have these plans."""
        return mrope_positions(seq_len, spans, plans, self.params.merge_size, [self.time_step(p) for p in plans])

    def plan(self, height: int, width: int) -> ImagePlan:
        return qwen_plan(height, width, self.params)

    def expand_image(self, plan: ImagePlan) -> tuple[list[int], list[int]]:
        start, end = self.frame_ids
        return [start] + [self.image_token_id] * plan.num_tokens + [end], [FRAME] + [IMAGE] * plan.num_tokens + [FRAME]

    def positions(self, layout: TokenLayout, plans: list[ImagePlan], clip_plans: list = ()) -> tuple[np.ndarray, int]:
        """M-RoPE over the images' and the clips' spans in sequence order (Qwen3-VL: a clip's per temporal patch)."""
        clip_spans = [span for plan in clip_plans for span in plan.spans]
        spans, ordered = zip(*sorted([*zip(layout.image_spans, plans), *zip(layout.video_spans, clip_spans,
                                                                            strict=True)],
                                     key=lambda span_plan: span_plan[0][0])) if plans or clip_spans else ((), ())
        return self.media_positions(len(layout.input_ids), list(spans), list(ordered))

    def reference_processor(self):
        from transformers import Qwen2VLImageProcessor

        p = self.params
        return Qwen2VLImageProcessor(
            patch_size=p.patch_size, merge_size=p.merge_size, temporal_patch_size=p.temporal_patch_size,
            size={"shortest_edge": p.min_pixels, "longest_edge": p.max_pixels},
            image_mean=list(p.image_mean), image_std=list(p.image_std))

    def reference_clip_rows(self, frames: np.ndarray, plan: VideoPlan) -> torch.Tensor:
        """A clip's rows from the video processor its rule names (Qwen2VLVideoProcessor; Qwen3VLVideoProcessor) on
        its sampled frames (the clip parity oracle): sized as the rule sizes them, an odd count padded with the last
        frame, two frames a temporal patch."""
        from transformers import Qwen2VLVideoProcessor, Qwen3VLVideoProcessor

        p, video = self.params, self.video_params
        processor = (Qwen3VLVideoProcessor if self.version == "qwen3_vl" else Qwen2VLVideoProcessor)(
            patch_size=p.patch_size, merge_size=p.merge_size, temporal_patch_size=p.temporal_patch_size,
            size={"shortest_edge": video.min_pixels, "longest_edge": video.max_pixels},
            image_mean=list(p.image_mean), image_std=list(p.image_std), max_video_tokens=video.max_video_tokens,
            do_sample_frames=False, cap_pixels_per_frame=True)
        clip = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2)
        return processor(videos=[clip], return_tensors="pt")["pixel_values_videos"]

    def load_encoder(self, device: torch.device, dtype: torch.dtype) -> QwenEncoder:
        """On the meta device: the header check alone, no tensor read (what batchvlm-estimate runs)."""
        config = hf_config(read_config(self.checkpoint), self.checkpoint)
        self.check_image_token(config.image_token_id)
        _check_against_tower(self.params, config.vision_config)
        if self.embedding in ("tower", "both") and self.version == "qwen2_5_vl":
            raise ConfigError("model.embedding=tower/both: Qwen2.5-VL's tower keeps its features in window order; "
                              "batchvlm stores its merger tokens only (model.embedding=auto)")
        embedding = "projector" if self.embedding == "auto" else self.embedding  # the merger is the projector
        parts, checked = self.load_parts(vision_parts, device, dtype)
        encoder = QwenEncoder(parts[TOWER], embedding, self.params.merge_size, self.version,
                              resolve_attention(self.attention, device, dtype)).to(device).eval()
        encoder.checked = checked
        return encoder

    def just_over_budget(self) -> tuple[int, int]:
        factor = self.params.factor
        return factor * 16, self.params.max_pixels // (factor * 16) + factor

    def fingerprint(self) -> dict:
        return {"family": self.name, "version": self.version, "processor": dataclasses.asdict(self.params),
                "embedding": self.embedding, "tokenizer": tokenizer_digest(self.tokenizer)}

    def video_fingerprint(self) -> dict | None:
        """What a clip's output depends on beyond the image processor: the rule, its parameters as the checkpoint
        gives them, Qwen2.5-VL's tokens_per_second and the positions' rule (the authors' `mrope_positions`, not
        transformers 5.25's `get_rope_index`, which differs after a long clip: docs/video.md). None: no clip taken."""
        if self.video_rule is None:
            return None
        positions = ("mrope_positions, a (1, h, w) span per temporal patch (get_rope_index's)" if self.version ==
                     "qwen3_vl" else "mrope_positions (the authors' rule)")
        return {"rule": self.video_rule, "params": dataclasses.asdict(self.video_params),
                "tokens_per_second": self.tokens_per_second, "positions": positions}


def _video_token_id(tokenizer, raw: dict) -> int | None:
    """The tokenizer's `<|video_pad|>` where the checkpoint's LLM reads clips' embeddings there (config.json's
    video_token_id, top level or in text_config); None otherwise: the family then takes no clip."""
    found = optional_token_id(tokenizer, VIDEO_TOKEN)
    stated = raw.get("video_token_id", (raw.get("text_config") or {}).get("video_token_id"))
    return found if found is not None and stated == found else None


def _tokens_per_second(raw: dict, path: Path) -> float:
    """Qwen2.5-VL's M-RoPE time steps per second of a clip, as transformers reads it from the checkpoint (its
    default where config.json states none)."""
    return float(hf_config(raw, path).vision_config.tokens_per_second)


def _check_against_tower(params: QwenProcessorParams, vision) -> None:
    """Processor parameters the tower's weights fix: a different value could only fail every record, late."""
    for ours, theirs in (("patch_size", "patch_size"), ("merge_size", "spatial_merge_size"),
                         ("temporal_patch_size", "temporal_patch_size")):
        if getattr(params, ours) != getattr(vision, theirs):
            raise ConfigError(f"model.processor.{ours}={getattr(params, ours)} but the checkpoint's tower has "
                              f"{theirs}={getattr(vision, theirs)}")


def _model_type(checkpoint: Path) -> str:
    model_type = read_config(checkpoint).get("model_type")
    if model_type not in VERSIONS:
        raise ConfigError(f"model.path={checkpoint} holds a {model_type!r} checkpoint, not one of "
                          f"{', '.join(VERSIONS)}")
    return model_type


def from_config(model: ModelConfig) -> Qwen2VL:
    checkpoint, tokenizer = checkpoint_and_tokenizer(model)
    params = QwenProcessorParams.from_checkpoint(checkpoint, dict(model.processor))
    return Qwen2VL(checkpoint, params, tokenizer, model.embedding, model.attn_implementation)


# -- the checkpoint: config.json's fields, the tensors' names ------------------------------------
TOWER = "visual."
LAYOUTS = (Layout("released", (TOWER,), (Rename(TOWER, TOWER),)),
           Layout("transformers", ("model.visual.",), (Rename("model.visual.", TOWER),)))
"""Qwen2-VL and Qwen2.5-VL are released with their tower and merger under visual.*, Qwen3-VL under model.visual.*
(transformers' names for all three); the names below either prefix are the tower's own."""
RELEASED = {"qwen2_vl": LAYOUTS[0], "qwen2_5_vl": LAYOUTS[0], "qwen3_vl": LAYOUTS[1]}
LANGUAGE_MODEL = {"qwen2_vl": "model.", "qwen2_5_vl": "model.", "qwen3_vl": "model.language_model."}
"""Where each version's release keeps its LLM's tensors (lm_head.weight aside)."""


def hf_config(raw: dict, path: Path):
    """transformers' config of a checkpoint's config.json (its classes read Qwen's released fields, flat or nested),
    less the LLM's quantization_config; the released vision fields transformers has no use for checked against the
    ones it has."""
    from transformers import AutoConfig

    model_type = raw.get("model_type")
    if model_type not in VERSIONS:
        raise ConfigError(f"model.path={path} holds a {model_type!r} checkpoint, not one of {', '.join(VERSIONS)}")
    vision = dict(raw.get("vision_config") or {})
    vision["in_channels"] = config_field(path, (vision, "in_chans", "in_channels"), default=3)
    if vision.pop("spatial_patch_size", vision.get("patch_size")) != vision.get("patch_size"):
        raise ConfigError(f"{path / 'config.json'}: vision_config.spatial_patch_size differs from its patch_size")
    vision.pop("in_chans", None)
    text = {key: value for key, value in raw.items() if key not in ("vision_config", "quantization_config")}
    if isinstance(text.get("text_config"), dict):
        text["text_config"] = {k: v for k, v in text["text_config"].items() if k != "quantization_config"}
    return AutoConfig.for_model(**text, vision_config=vision)


def vision_parts(raw: dict, path: Path, dtype: torch.dtype = torch.float32,
                 attention: str = "sdpa") -> tuple[dict[str, torch.nn.Module], tuple[Layout, ...]]:
    """The tower with its merger(s) transformers runs, built from config.json (its init is overwritten by the load),
    and the layouts its tensors are stored in, the version's released one first."""
    config = hf_config(raw, path)
    module, cls = VERSIONS[config.model_type]
    tower = getattr(importlib.import_module(module), cls)._from_config(config.vision_config, dtype=dtype,
                                                                          attn_implementation=attention)
    released = RELEASED[config.model_type]
    return {TOWER: tower}, (released, *(layout for layout in LAYOUTS if layout is not released))


# -- tiny checkpoint ---------------------------------------------------------------------------
QWEN_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>", "<|im_start|>", "<|im_end|>"]


TINY_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=8192, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
                 rope_theta=10000.0)
TINY_VISION = dict(depth=2, embed_dim=32, mlp_ratio=2, num_heads=2, in_chans=3, hidden_size=64, patch_size=14,
                   spatial_merge_size=2, spatial_patch_size=14, temporal_patch_size=2)
BASE_VISION = dict(TINY_VISION, depth=12, embed_dim=768, mlp_ratio=4, num_heads=12)
"""A ViT-B-sized tower (the merger still projects to the tiny LLM's width) for the clip benchmarks, where the tower
must cost what a real one does."""


def released_config(tokenizer, vision: dict = TINY_VISION) -> dict:
    """config.json as Qwen releases Qwen2-VL's (flat, its vision_config by the release's names), tiny, with the
    tokenizer's ids."""
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in (
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"),
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"))}
    return {"architectures": ["Qwen2VLForConditionalGeneration"], "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id, **ids, "hidden_act": "silu", "model_type": "qwen2_vl",
            "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "torch_dtype": "float32", **TINY_TEXT,
            "vision_config": vision, "vocab_size": len(tokenizer)}


def demo_tokenizer(ids: dict[str, int] | None = None):
    """The tiny checkpoint's tokenizer, with the published chat template; `ids` places special tokens at a release's
    ids."""
    return tiny_tokenizer(QWEN_TOKENS, published_template("qwen2_vl"), ids)


def write_tiny_checkpoint(folder: Path, vision: dict = TINY_VISION) -> None:
    """Vision tower + merger + a 2-layer LLM as Qwen releases Qwen2-VL (config.json, names), from a config with a fixed
    seed; Qwen2-VL's chat template."""
    from transformers import Qwen2VLImageProcessor

    tokenizer = demo_tokenizer()
    write_checkpoint(folder, released_config(tokenizer, vision))
    tokenizer.save_pretrained(folder)
    # A small max_pixels keeps the demo fast on a CPU and sends its larger photos down the shrinking branch.
    Qwen2VLImageProcessor(size={"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 256}).save_pretrained(folder)


def write_base_checkpoint(folder: Path) -> None:
    """The tiny checkpoint with a ViT-B-sized tower (BASE_VISION)."""
    write_tiny_checkpoint(folder, BASE_VISION)


def write_checkpoint(folder: Path, config: dict, language_model: bool = True, seed: int = 0) -> None:
    """A checkpoint of `config` (config.json as released, any of the three versions) in its version's released layout,
    every tensor of non-trivial values, deterministic; with `language_model`, its LLM too, which the job never reads."""
    from transformers import AutoModelForImageTextToText

    hf = hf_config(config, folder)
    torch.manual_seed(seed)
    llm = {}
    if language_model:
        model = nontrivial(AutoModelForImageTextToText.from_config(hf), seed)
        parts = {TOWER: model.model.visual}
        llm = {LANGUAGE_MODEL[hf.model_type] + name: tensor for name, tensor in
               model.model.language_model.state_dict().items()} | {"lm_head.weight": model.lm_head.weight}
    else:
        parts = {prefix: nontrivial(part, seed) for prefix, part in vision_parts(config, folder)[0].items()}
    write_released(folder, config, RELEASED[hf.model_type], parts, llm)
