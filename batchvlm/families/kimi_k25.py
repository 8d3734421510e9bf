"""Kimi-K2.5 / K3-style MoonViT (NaViT packing): Kimi-VL (arXiv 2504.07491), moonshotai/Kimi-K2.5 on the Hugging Face
Hub, transformers' Kimi_K25 model and image processor.

Resize: scale down to a patch budget (never up), truncate, pad bottom/right to a multiple of
merge*patch. Patches (N, C, p, p) in raster order; the tower merges 2x2 itself. Prompt: K3 framing
`<|media_begin|>image {W}x{H}<|media_content|>` + pad * n + `<|media_end|>`, or K2.5's bare repeat.

Clips (VIDEO_RULE): frames sampled at min(sample_fps, the clip's rate), in chunks of temporal_merge_kernel_size frames,
each chunk resized as an image under its per-frame patch limit, prompted `{hh:mm:ss.fff}<|media_begin|>video
<|media_content|>` + pad * (h/2)(w/2) + `<|media_end|>`; the tower adds a time embedding per frame and averages a
chunk's frames (docs/video.md).
"""

from __future__ import annotations

import dataclasses
import functools
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
from batchvlm.families.common import (PatchFamily, checkpoint_and_tokenizer, choose_projector, config_field,
                                      optional_token_id, processor_params, published_template, read_config,
                                      tiny_tokenizer, token_id, tokenizer_digest, tower_inputs)
from batchvlm.towers.attention import resolve_attention, use
from batchvlm.towers.grids import PerGrid, interpolation_taps, joined
from batchvlm.format.layouts import RASTER_CHW, PatchLayout
from batchvlm.records import ImagePlan
from batchvlm.format.schema import FRAME, IMAGE

IMAGE_TOKEN = "<|media_pad|>"
FRAME_TOKENS = ("<|media_begin|>", "<|media_content|>", "<|media_end|>")
VIDEO_TOKEN = "<|kimi_k25_video_placeholder|>"
"""Where Kimi-K2.5's chat template puts a clip, and transformers' Kimi_K25Processor its chunks' pads (the checkpoint's
remote code and vLLM pad chunks with <|media_pad|> instead: the embeddings land on the same places either way)."""
VIDEO_RULE = ("Kimi-K2.5's checkpoint processor (kimi_k25_vision_processing.split_video_chunks, "
              "media_utils.navit_resize_video): min(sample_fps, video fps), linspace(0, n-1, k).round(), chunks of "
              "temporal_merge_kernel_size frames, the last one shorter; chunk prompts as transformers' "
              "Kimi_K25Processor")
"""The one reference batchvlm samples, chunks, sizes and prompts Kimi-K2.5 clips by. transformers' video processor
samples otherwise (fps 2 by arange(n) * total // n, no min with the clip's rate) and has no in_patch_limit_video: it is
the oracle of grids, pixels and ids on frames sampled by this rule, not of the sampling."""


@dataclass(frozen=True)
class KimiProcessorParams:
    patch_size: int = 14
    merge_size: int = 2
    max_patches: int = 16384
    """in_patch_limit (L): the patch budget, checked on the floored source size."""
    max_patches_per_side: int = 512
    """patch_limit_on_one_side (S)."""
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    @classmethod
    def from_checkpoint(cls, path: Path, overrides: dict) -> "KimiProcessorParams":
        return processor_params(cls, _read_processor_config(path), overrides, "kimi_k25")


def _read_processor_config(path: Path) -> dict:
    """Processor parameters from the checkpoint: HF `preprocessor_config.json` or Moonshot's `media_proc_cfg`."""
    file = path / "preprocessor_config.json"
    if not file.exists():
        return {}
    raw = json.loads(file.read_text())
    if "media_proc_cfg" in raw:
        media = raw["media_proc_cfg"]
        if media.get("fixed_output_tokens") is not None:
            raise ConfigError(f"{file}: fixed_output_tokens is set, which decouples token counts from grids; "
                              "batchvlm refuses it rather than write spans that disagree with the embeddings")
        mapping = {"patch_size": "patch_size", "merge_kernel_size": "merge_size", "in_patch_limit": "max_patches",
                   "patch_limit_on_one_side": "max_patches_per_side", "image_mean": "image_mean",
                   "image_std": "image_std"}
        return {ours: media[theirs] for theirs, ours in mapping.items() if theirs in media}
    values = {k: raw[k] for k in ("patch_size", "merge_size", "max_patches", "image_mean", "image_std") if k in raw}
    if "size" in raw and "max_height" in raw["size"]:
        values["max_patches_per_side"] = raw["size"]["max_height"]
    return values


def navit_plan(height: int, width: int, params: KimiProcessorParams) -> ImagePlan:
    """The NaViT resize rule, in the same double-precision operations and order as the reference."""
    p, m = params.patch_size, params.merge_size
    limit, side = params.max_patches, params.max_patches_per_side
    patches_h = max(1, height // p)
    patches_w = max(1, width // p)
    scale = min(1.0, math.sqrt(limit / (patches_h * patches_w)), side * p / height, side * p / width)
    new_h = min(max(1, int(height * scale)), side * p)
    new_w = min(max(1, int(width * scale)), side * p)
    factor = m * p
    pad_h = new_h + (factor - new_h % factor) % factor
    pad_w = new_w + (factor - new_w % factor) % factor
    grid = (1, pad_h // p, pad_w // p)
    return ImagePlan(original=(height, width), resized=(new_h, new_w), padded=(pad_h, pad_w), grid_thw=grid,
                     num_tokens=grid[1] * grid[2] // (m * m))


@dataclass(frozen=True)
class KimiVideoParams:
    """A clip's sampling, chunking and patch limits, named as Kimi-K2.5's media_proc_cfg names them; the defaults are
    the release's."""

    sample_fps: float = 2.0
    """Frames sampled per second, at most the clip's own rate."""
    temporal_merge_kernel_size: int = 4
    """Frames in a chunk: the tower pools them into one frame's tokens."""
    in_patch_limit_each_frame: int | None = 4096
    """A frame's patch budget (None: the image's, in_patch_limit)."""
    in_patch_limit_video: int | None = None
    """Shared by a chunk's frames (the reference resizes a chunk, not the whole clip, against it)."""
    timestamp_mode: str = "hh:mm:ss.fff"

    def __post_init__(self):
        positive = {"sample_fps": self.sample_fps, "temporal_merge_kernel_size": self.temporal_merge_kernel_size,
                    "in_patch_limit_each_frame": self.in_patch_limit_each_frame or 1,
                    "in_patch_limit_video": self.in_patch_limit_video or 1}
        for key, value in positive.items():
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(f"kimi_k25 media_proc_cfg.{key}={value!r}: must be > 0")
        if self.timestamp_mode not in TIMESTAMP_MODES:
            raise ConfigError(f"kimi_k25 media_proc_cfg.timestamp_mode={self.timestamp_mode!r}: one of "
                              f"{', '.join(TIMESTAMP_MODES)}")

    @classmethod
    def from_checkpoint(cls, path: Path) -> "KimiVideoParams":
        """The checkpoint's media_proc_cfg values (preprocessor_config.json), the release's where it states none."""
        file = path / "preprocessor_config.json"
        media = json.loads(file.read_text()).get("media_proc_cfg", {}) if file.exists() else {}
        return cls(**{f.name: media[f.name] for f in dataclasses.fields(cls) if f.name in media})


TIMESTAMP_MODES = ("hh:mm:ss.fff", "mm:ss.fff", "mm:ss")


def timestamp_text(seconds: float, mode: str) -> str:
    """A chunk's time as the reference writes it: UTC clock fields of the whole seconds, milliseconds truncated."""
    whole = int(seconds)
    hours, minutes, secs = whole // 3600 % 24, whole // 60 % 60, whole % 60
    millis = f".{int(seconds % 1 * 1000):03d}"
    return {"hh:mm:ss.fff": f"{hours:02d}:{minutes:02d}:{secs:02d}{millis}",
            "mm:ss.fff": f"{minutes:02d}:{secs:02d}{millis}", "mm:ss": f"{minutes:02d}:{secs:02d}"}[mode]


def kimi_sample_frames(total: int, video_fps: float, video: KimiVideoParams) -> list[int]:
    """min(sample_fps, video_fps) frames per second of the clip (at least one), spread by linspace and rounded."""
    require(total >= 1, "video.too_few_frames", "the clip has no frame", expected=">= 1 frame", observed=total)
    rate = min(video.sample_fps, video_fps)
    count = max(round(total * rate / video_fps), 1)
    return np.linspace(0, total - 1, count).round().astype(int).tolist()


@dataclass(frozen=True)
class VideoChunk:
    frames: tuple[int, ...]
    """The chunk's sampled frames (indices into the clip)."""
    start_s: float
    """Its first frame's index / the clip's frame rate: the reference's time (the pts are in video_frame_times)."""
    plan: ImagePlan
    """Every frame's resize and padding; grid_thw (frames, h, w)."""

    @property
    def num_tokens(self) -> int:
        return self.plan.num_tokens


@dataclass(frozen=True)
class KimiVideoPlan:
    indices: tuple[int, ...]
    chunks: tuple[VideoChunk, ...]

    @property
    def num_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)

    @property
    def num_patches(self) -> int:
        return sum(chunk.plan.num_patches for chunk in self.chunks)

    @property
    def parts(self) -> tuple[ImagePlan, ...]:
        """What the tower encodes and the output stores of the clip (records.clip_parts): its chunks."""
        return tuple(chunk.plan for chunk in self.chunks)

    @property
    def grids(self) -> list[tuple[int, int, int]]:
        return [chunk.plan.grid_thw for chunk in self.chunks]

    @property
    def spans(self) -> tuple[ImagePlan, ...]:
        """The spans the clip lays out in the ids: a chunk's each (its pads between its frame tokens)."""
        return self.parts


def chunk_patch_limit(frames: int, params: KimiProcessorParams, video: KimiVideoParams) -> int:
    """A chunk's per-frame patch budget: in_patch_limit_each_frame (else in_patch_limit), at most in_patch_limit_video
    shared by the chunk's frames (navit_resize_video on a chunk: its frames at 1 fps, sampled at inf)."""
    each = params.max_patches if video.in_patch_limit_each_frame is None else video.in_patch_limit_each_frame
    if video.in_patch_limit_video is not None:
        each = min(round(video.in_patch_limit_video / frames), each)
    return each


def kimi_video_plan(indices: list[int], video_fps: float, height: int, width: int, params: KimiProcessorParams,
                    video: KimiVideoParams) -> KimiVideoPlan:
    """The sampled frames in chunks of temporal_merge_kernel_size (the last one shorter where they do not divide), each
    chunk's frames resized as one image under its patch limit; a chunk's tokens are one frame's: the tower pools t."""
    size = video.temporal_merge_kernel_size
    chunks = []
    for start in range(0, len(indices), size):
        frames = tuple(indices[start:start + size])
        plan = navit_plan(height, width, dataclasses.replace(
            params, max_patches=chunk_patch_limit(len(frames), params, video)))
        chunks.append(VideoChunk(frames, frames[0] / video_fps,
                                 dataclasses.replace(plan, grid_thw=(len(frames), *plan.grid_thw[1:]))))
    return KimiVideoPlan(tuple(indices), tuple(chunks))


class KimiEncoder(torch.nn.Module):
    """MoonViT tower (+ projector): packed (N, C, p, p) patches and grids in, per-image tokens out."""

    def __init__(self, tower: torch.nn.Module, projector: torch.nn.Module | None, merge_size: int, keep_tower: bool,
                 attention: str):
        super().__init__()
        self.tower = tower
        self.attention = use(tower, attention)
        self.projector = projector
        self.merge_area = merge_size * merge_size
        self.keep_tower = keep_tower
        tower_size = tower.config.hidden_size * self.merge_area
        self.hidden_sizes = {"image_embeds": projector.out_proj.out_features if projector is not None else tower_size}
        if keep_tower:
            self.hidden_sizes["tower_embeds"] = tower_size
        self.hidden_size = self.hidden_sizes["image_embeds"]
        self.per_grid = PerGrid(self.image_inputs)

    def inputs(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """The tower's inputs for a batch of the host grid `grid_thw`: what MoonViT computes from the grid (rotary
        positions, the bicubic taps of its position table, frame indices, the 2x2 merge's scatter index), each image's
        part computed once per grid on the host (towers.grids), joined here (common.tower_inputs)."""
        from transformers.vision_utils import get_vision_cu_seqlens

        parts = self.per_grid(grid_thw)
        kernel = math.prod(self.tower.merge_kernel_size)
        merged = [part["merged"] for part in parts]
        offsets = [sum(merged[:i]) * kernel for i in range(len(parts))]
        destination = torch.cat([part["destination"] + offset for part, offset in zip(parts, offsets)])
        indices = {name: joined(parts, name) for name in ("position_ids", "interp_indices", "interp_weights",
                                                          "frame_index")}
        indices["temporal_merge_index"] = (destination, joined(parts, "frame_weight"), sum(merged))
        return tower_inputs(self.tower, pixel_values, self.attention, indices,
                            {"cu_seqlens": get_vision_cu_seqlens(grid_thw, merge_temporal=True)})

    def image_inputs(self, grid: tuple[int, int, int]) -> dict:
        """One image's part of `inputs`, by transformers' functions on its grid alone (the taps by grids.py's)."""
        from transformers.models.kimi_k25.modeling_kimi_k25 import (get_vision_frame_index,
                                                                    get_vision_temporal_merge_index)
        from transformers.vision_utils import get_vision_position_ids

        one = torch.tensor([grid])
        table = self.tower.patch_embed.pos_emb
        taps, weights = interpolation_taps(grid, table.num_grid_per_side, table.interpolation_mode,
                                           table.interpolation_align_corners)
        destination, frame_weight, merged = get_vision_temporal_merge_index(one, *self.tower.merge_kernel_size)
        return {"position_ids": get_vision_position_ids(one, spatial_merge_size=1), "interp_indices": taps,
                "interp_weights": weights, "frame_index": get_vision_frame_index(one), "destination": destination,
                "frame_weight": frame_weight, "merged": merged}

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> dict[str, list[torch.Tensor]]:
        """`grid_thw` on the host (the batch's planned grids), so that nothing here waits for the device."""
        pixel_values, kwargs = self.inputs(pixel_values, grid_thw)
        device_grid = to_device(grid_thw, pixel_values.device)
        merged = self.tower(pixel_values, grid_thw=device_grid, **kwargs).pooler_output  # [tokens, m*m, D]
        tower_tokens = merged.reshape(merged.shape[0], -1)
        sizes = (grid_thw[:, 1] * grid_thw[:, 2] // self.merge_area).tolist()
        split = lambda tokens: list(torch.split(tokens, sizes))  # noqa: E731
        if self.projector is None:
            return {"image_embeds": split(tower_tokens)}
        outputs = {"image_embeds": split(self.projector(merged).squeeze(1))}
        if self.keep_tower:
            outputs["tower_embeds"] = split(tower_tokens)
        return outputs


class KimiK25(PatchFamily):
    name = "kimi_k25"
    resample = "bicubic"
    frame_tokens = FRAME_TOKENS

    def __init__(self, checkpoint: Path, params: KimiProcessorParams, tokenizer, framing: str,
                 embedding: str, attn_implementation: str):
        super().__init__(checkpoint, params, tokenizer, embedding, attn_implementation,
                         PatchLayout(RASTER_CHW, params.patch_size, params.merge_size), IMAGE_TOKEN)
        self.framing = framing
        if framing == "k3":
            self.frame_ids = [token_id(tokenizer, token, self.name) for token in FRAME_TOKENS]
        self.video_params = KimiVideoParams.from_checkpoint(checkpoint)
        raw = read_config(checkpoint)
        # A chunk's frames index the tower's time table: a chunk longer than it has no time for its last frames.
        vision = raw if raw.get("model_type") == "kimi_k25_vision" else raw.get("vision_config") or {}
        times = vision.get("init_pos_emb_time", vision.get("pos_emb_time", 4))
        fits = self.video_params.temporal_merge_kernel_size <= times
        self.video_token_id = _video_token_id(tokenizer, raw) if fits else None

    # -- plan and layout ------------------------------------------------------------------------
    def plan(self, height: int, width: int) -> ImagePlan:
        return navit_plan(height, width, self.params)

    def expand_image(self, plan: ImagePlan) -> tuple[list[int], list[int]]:
        pads = [self.image_token_id] * plan.num_tokens
        if self.framing == "plain":
            return pads, [IMAGE] * len(pads)
        begin, content, end = self.frame_ids
        height, width = plan.original
        # The frame names the original uploaded size, not the resized one (K3 contract).
        head = [begin] + self.encode_text(f"image {width}x{height}") + [content]
        return head + pads + [end], [FRAME] * len(head) + [IMAGE] * len(pads) + [FRAME]

    # -- clips ----------------------------------------------------------------------------------
    @property
    def video_rule(self) -> str | None:
        """The rule clips are taken by; None where the tokenizer lacks the checkpoint's clip token or a chunk is longer
        than the tower's time table (a record with clips is then text.video)."""
        return VIDEO_RULE if self.video_token_id is not None else None

    def video_sampler(self) -> functools.partial:
        """(frames in a clip, its fps) -> the frames sampled (pipeline.video.Sampler), picklable for the decoder."""
        return functools.partial(kimi_sample_frames, video=self.video_params)

    def plan_video(self, indices: list[int], total: int, video_fps: float, height: int, width: int,
                   times: list[float] | None = None) -> KimiVideoPlan:
        """A clip's chunks from its sampled frames, its header's rate and its frames' upright size. A chunk's time is
        its first frame's index / fps, as the reference writes it, not the frames' pts `times`."""
        return kimi_video_plan(indices, video_fps, height, width, self.params, self.video_params)

    def video_prompt(self, plan: KimiVideoPlan) -> str:
        """The text that stands for a clip where the chat template renders its placeholder (pipeline.chat tokenizes it
        with the text around it, as Kimi_K25Processor does): per chunk its time as plain text, then
        `<|media_begin|>video<|media_content|>`, the placeholder (expanded to the chunk's tokens), `<|media_end|>`."""
        begin, content, end = FRAME_TOKENS
        return "".join(f"{timestamp_text(chunk.start_s, self.video_params.timestamp_mode)}{begin}video{content}"
                       f"{VIDEO_TOKEN}{end}" for chunk in plan.chunks)

    def video_fingerprint(self) -> dict | None:
        """What a clip's output depends on beyond the image processor: the rule and its parameters as read."""
        if self.video_rule is None:
            return None
        return {"rule": VIDEO_RULE, "params": dataclasses.asdict(self.video_params),
                "video_token_id": self.video_token_id}

    # -- pixels ---------------------------------------------------------------------------------
    def reference_processor(self):
        from transformers import Kimi_K25ImageProcessor

        p = self.params
        return Kimi_K25ImageProcessor(
            patch_size=p.patch_size, merge_size=p.merge_size, max_patches=p.max_patches,
            size={"max_height": p.max_patches_per_side, "max_width": p.max_patches_per_side},
            image_mean=list(p.image_mean), image_std=list(p.image_std))

    def reference_clip_rows(self, frames: np.ndarray, plan: KimiVideoPlan) -> torch.Tensor:
        """A clip's rows from transformers' Kimi_K25VideoProcessor (the clip parity oracle), chunk by chunk: each
        chunk's frames as one temporal patch under the chunk's per-frame patch budget (chunk_patch_limit)."""
        from transformers import Kimi_K25VideoProcessor

        p, rows, start = self.params, [], 0
        for chunk in plan.chunks:
            count = len(chunk.frames)
            processor = Kimi_K25VideoProcessor(
                patch_size=p.patch_size, merge_size=p.merge_size, temporal_patch_size=count,
                max_patches=chunk_patch_limit(count, p, self.video_params),
                size={"max_height": p.max_patches_per_side, "max_width": p.max_patches_per_side},
                image_mean=list(p.image_mean), image_std=list(p.image_std), do_sample_frames=False)
            video = torch.from_numpy(np.ascontiguousarray(frames[start:start + count])).permute(0, 3, 1, 2)
            rows.append(processor(videos=[video], return_tensors="pt")["pixel_values_videos"])
            start += count
        return torch.cat(rows)

    # -- tower ----------------------------------------------------------------------------------
    def load_encoder(self, device: torch.device, dtype: torch.dtype) -> KimiEncoder:
        """On the meta device: the header check alone, no tensor read (what batchvlm-estimate runs)."""
        raw = read_config(self.checkpoint)
        if raw.get("model_type") == "kimi_k25":
            self.check_image_token(hf_config(raw, self.checkpoint).image_token_id)
        parts, checked = self.load_parts(vision_parts, device, dtype)
        projector = choose_projector(self.embedding, parts.get(PROJECTOR))
        encoder = KimiEncoder(parts[TOWER], projector, self.params.merge_size, self.embedding == "both",
                              resolve_attention(self.attention, device, dtype)).to(device).eval()
        encoder.checked = checked
        return encoder

    def just_over_budget(self) -> tuple[int, int]:
        side, p = math.isqrt(self.params.max_patches), self.params.patch_size
        return p * side, p * (side + 1)  # one column of patches over max_patches

    def fingerprint(self) -> dict:
        return {"family": self.name, "processor": dataclasses.asdict(self.params), "framing": self.framing,
                "embedding": self.embedding, "tokenizer": tokenizer_digest(self.tokenizer)}


def _video_token_id(tokenizer, raw: dict) -> int | None:
    """The tokenizer's clip token where the checkpoint's LLM reads clips there (config.json's video_token_id, where it
    states one, is the same id); None otherwise: the family then takes no clip."""
    found = optional_token_id(tokenizer, VIDEO_TOKEN)
    stated = raw.get("video_token_id")
    return found if found is not None and stated in (None, found) else None


# -- the checkpoint: config.json's fields, the tensors' names ------------------------------------
TOWER, PROJECTOR = "vision_tower.", "mm_projector."
VISION_FIELDS = (("vt_hidden_size", "hidden_size"), ("vt_num_hidden_layers", "num_hidden_layers"),
                 ("vt_num_attention_heads", "num_attention_heads"), ("vt_intermediate_size", "intermediate_size"),
                 ("init_pos_emb_height", "pos_emb_height"), ("init_pos_emb_width", "pos_emb_width"),
                 ("init_pos_emb_time", "pos_emb_time"), ("patch_size", "patch_size"),
                 ("merge_kernel_size", "merge_kernel_size"))
"""The tower's dims as Moonshot's released vision_config names them, and as transformers' Kimi_K25VisionConfig does."""
VARIANT = {"merge_type": "sd2_tpool", "mm_projector_type": "patchmerger", "pos_emb_type": "divided_fixed",
           "projector_hidden_act": "gelu"}
"""Released vision_config fields that name a MoonViT variant: the values transformers' modules implement."""


def hf_config(raw: dict, path: Path):
    """transformers' Kimi_K25Config of a checkpoint's config.json, its vision dims, projector and image token taken
    from the fields the release names them by (`vt_*`, `init_pos_emb_*`, `mm_hidden_size`, `text_hidden_size`,
    `projector_ln_eps`, `media_placeholder_token_id`) or from transformers' own; the language model's config as it is,
    less its quantization_config (the job reads no tensor of it, and so needs none of its quantization code)."""
    from transformers import Kimi_K25Config

    if raw.get("model_type") not in ("kimi_k25", "kimi_k25_vision"):
        raise ConfigError(f"model.path={path} holds a {raw.get('model_type')!r} checkpoint, not kimi_k25 or "
                          "kimi_k25_vision")
    vision = raw if raw.get("model_type") == "kimi_k25_vision" else raw.get("vision_config") or {}
    for key, value in VARIANT.items():
        if vision.get(key, value) != value:
            raise ConfigError(f"{path / 'config.json'}: vision_config.{key}={vision[key]!r}, a MoonViT variant "
                              f"batchvlm does not implement (it runs {key}={value!r})")
    dims = {ours: config_field(path, (vision, released, ours)) for released, ours in VISION_FIELDS}
    text = {key: value for key, value in (raw.get("text_config") or {}).items() if key != "quantization_config"}
    # A tower saved alone has no projector and reads no token: only the full checkpoint must name them.
    alone = {"default": None} if raw["model_type"] == "kimi_k25_vision" else {}
    text["hidden_size"] = config_field(path, (vision, "text_hidden_size"), (text, "hidden_size"), **alone)
    token = config_field(path, (raw, "media_placeholder_token_id", "image_token_id"), **alone)
    return Kimi_K25Config(
        text_config={key: value for key, value in text.items() if value is not None},
        vision_config={**dims, "hidden_act": vision.get("hidden_act", "gelu_pytorch_tanh")},
        # the projector's norm runs over the tower's width: that is its width where the file does not say
        projection_hidden_size=config_field(path, (vision, "mm_hidden_size"), (raw, "projection_hidden_size"),
                                            default=dims["hidden_size"]),
        projection_layer_norm_eps=config_field(path, (vision, "projector_ln_eps"), (raw, "projection_layer_norm_eps"),
                                               default=1e-5),
        image_token_id=Kimi_K25Config.image_token_id if token is None else token,
        tie_word_embeddings=raw.get("tie_word_embeddings", False))


def vision_parts(raw: dict, path: Path, dtype: torch.dtype = torch.float32,
                 attention: str = "sdpa") -> tuple[dict[str, torch.nn.Module], tuple[Layout, ...]]:
    """The tower (and the projector) transformers runs, built from config.json (their init is overwritten by the
    load), and the layouts their tensors are stored in, the released one first."""
    from transformers import Kimi_K25VisionModel
    from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25MultimodalProjection

    config = hf_config(raw, path)
    parts = {TOWER: Kimi_K25VisionModel._from_config(config.vision_config, dtype=dtype,
                                                      attn_implementation=attention)}
    if raw["model_type"] == "kimi_k25":
        parts[PROJECTOR] = Kimi_K25MultimodalProjection(config).to(dtype)
    return parts, layouts(raw["model_type"], config.vision_config.num_attention_heads)


def layouts(model_type: str, heads: int) -> tuple[Layout, ...]:
    """The names Kimi's vision tensors are stored under: Moonshot's release (MoonViT's blocks, the fused wqkv with
    each head's rotary pairs interleaved, proj.0/proj.2), transformers' (model.vision_tower.layers.*, q/k/v apart),
    what transformers 5's save_pretrained writes of the full model (the release's names, some under another prefix),
    and transformers' vision model saved alone (kimi_k25_vision)."""
    tower = lambda name: TOWER + name  # noqa: E731
    if model_type == "kimi_k25_vision":
        return (Layout("transformers", ("patch_embed.", "layers.", "final_layernorm."),
                       tuple(Rename(root, tower(root)) for root in ("patch_embed.", "layers.", "final_layernorm."))),)
    blocks = "vision_tower.encoder.blocks.{}."
    released = Layout("released", (TOWER, PROJECTOR), (
        Rename("vision_tower.patch_embed.proj.", tower("patch_embed.proj.")),
        Rename("vision_tower.patch_embed.pos_emb.weight", tower("patch_embed.pos_emb.position_embeddings")),
        Rename(blocks + "norm0.", tower("layers.{}.norm1.")),
        Rename(blocks + "norm1.", tower("layers.{}.norm2.")),
        Rename(blocks + "wqkv.", tuple(tower(f"layers.{{}}.attn.{x}_proj.") for x in "qkv"), interleaved_heads=heads),
        Rename(blocks + "wo.", tower("layers.{}.attn.proj.")),
        Rename(blocks + "mlp.fc0.", tower("layers.{}.mlp.fc1.")),
        Rename(blocks + "mlp.fc1.", tower("layers.{}.mlp.fc2.")),
        Rename("vision_tower.encoder.final_layernorm.", tower("final_layernorm.")),
        Rename("mm_projector.pre_norm.", PROJECTOR + "pre_norm."),
        Rename("mm_projector.proj.0.", PROJECTOR + "in_proj."),
        Rename("mm_projector.proj.2.", PROJECTOR + "out_proj.")))
    transformers = Layout("transformers", ("model.vision_tower.", "model.mm_projector."),
                          (Rename("model.vision_tower.", TOWER), Rename("model.mm_projector.", PROJECTOR)))
    saved = Layout("transformers-saved", (), (Rename("vision_tower.encoder.patch_embed.", tower("patch_embed.")),))
    return released, transformers, saved


def from_config(model: ModelConfig, family_class: type[KimiK25] = KimiK25) -> KimiK25:
    """The family (or a subclass that states its own difference, as a user's MoonViT family may) of a checkpoint."""
    checkpoint, tokenizer = checkpoint_and_tokenizer(model)
    params = KimiProcessorParams.from_checkpoint(checkpoint, dict(model.processor))
    return family_class(checkpoint, params, tokenizer, model.framing, model.embedding, model.attn_implementation)


# -- tiny checkpoint ---------------------------------------------------------------------------
MEDIA_TOKENS = ["<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>",
                "<|kimi_k25_video_placeholder|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
                "<|im_end|>"]

TINY_VISION = dict(vt_hidden_size=32, vt_intermediate_size=64, vt_num_hidden_layers=2, vt_num_attention_heads=2,
                   init_pos_emb_height=16, init_pos_emb_width=16)
BASE_VISION = dict(vt_hidden_size=768, vt_intermediate_size=3072, vt_num_hidden_layers=12, vt_num_attention_heads=12,
                   init_pos_emb_height=64, init_pos_emb_width=64)
"""A ViT-B-sized MoonViT for the end-to-end benchmark, where the tower must cost what a real one does."""
K25_VISION = dict(VARIANT, patch_size=14, merge_kernel_size=[2, 2], init_pos_emb_time=4, projector_ln_eps=1e-5,
                  video_attn_type="spatial_temporal", model_type="")
"""Kimi-K2.5's released vision_config, less its dims."""
TINY_TEXT = dict(model_type="deepseek_v3", hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                 num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                 num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16,
                 qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=8192, n_group=1,
                 topk_group=1)


def released_config(vision: dict, tokenizer) -> dict:
    """config.json as Moonshot releases Kimi-K2.5's, with `vision`'s dims, a one-layer LLM and the tokenizer's ids."""
    return {"architectures": ["KimiK25ForConditionalGeneration"], "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id, "media_placeholder_token_id": tokenizer.convert_tokens_to_ids(
                IMAGE_TOKEN), "model_type": "kimi_k25", "pad_token_id": tokenizer.pad_token_id,
            "text_config": dict(TINY_TEXT, vocab_size=len(tokenizer)), "tie_word_embeddings": False,
            "vision_config": dict(K25_VISION, **vision, mm_hidden_size=vision["vt_hidden_size"],
                                  text_hidden_size=TINY_TEXT["hidden_size"])}


def demo_tokenizer(ids: dict[str, int] | None = None):
    """The tiny checkpoint's tokenizer, with the published chat template; `ids` places special tokens at a release's
    ids."""
    return tiny_tokenizer(MEDIA_TOKENS, published_template("kimi_k25"), ids)


def write_tiny_checkpoint(folder: Path, vision: dict = TINY_VISION) -> None:
    """MoonViT tower + projector + a one-layer LLM as Moonshot releases them (config.json, names, media_proc_cfg),
    from a config with a fixed seed; Kimi-K2.5's chat template."""
    tokenizer = demo_tokenizer()
    write_checkpoint(folder, released_config(vision, tokenizer))
    tokenizer.save_pretrained(folder)
    media = {"in_patch_limit": 16384, "patch_size": 14, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
             "merge_kernel_size": 2, "fixed_output_tokens": None, "patch_limit_on_one_side": 512}
    (folder / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": media}, indent=2))


def write_checkpoint(folder: Path, config: dict, language_model: bool = True, seed: int = 0) -> None:
    """A checkpoint of `config` (config.json as released) in the released layout, every tensor of non-trivial values,
    deterministic; with `language_model`, its LLM too (under language_model.*), which the job never reads."""
    from transformers import Kimi_K25ForConditionalGeneration

    hf = hf_config(config, folder)
    torch.manual_seed(seed)
    llm = {}
    if language_model:
        model = nontrivial(Kimi_K25ForConditionalGeneration(hf), seed)
        parts = {TOWER: model.model.vision_tower, PROJECTOR: model.model.mm_projector}
        llm = {f"language_model.model.{name}": tensor for name, tensor in
               model.model.language_model.state_dict().items()} | {"language_model.lm_head.weight": model.lm_head.weight}
    else:
        parts = {prefix: nontrivial(part, seed) for prefix, part in vision_parts(config, folder)[0].items()}
    write_released(folder, config, layouts("kimi_k25", hf.vision_config.num_attention_heads)[0], parts, llm)


def write_base_checkpoint(folder: Path) -> None:
    """The tiny checkpoint with a ViT-B-sized tower (BASE_VISION)."""
    write_tiny_checkpoint(folder, BASE_VISION)
