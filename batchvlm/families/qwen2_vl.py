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
from batchvlm.families.common import (PatchFamily, checkpoint_and_tokenizer, load_submodule, processor_params,
                                      published_template, tiny_tokenizer, token_id, tokenizer_digest,
                                      tower_inputs)
from batchvlm.format.layouts import MERGE_WINDOW, PatchLayout
from batchvlm.records import ImagePlan, TokenLayout
from batchvlm.format.schema import FRAME, IMAGE

IMAGE_TOKEN = "<|image_pad|>"
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


def smart_resize(height: int, width: int, params: QwenProcessorParams) -> tuple[int, int]:
    """The processor's rule, pinned to transformers 5.24: half-even rounding, max(factor, .) only when shrinking."""
    factor = params.factor
    ratio = max(height, width) / min(height, width)
    require(ratio <= MAX_ASPECT_RATIO, "plan.size_rule", f"aspect ratio {ratio:.1f} is over the "
            f"{MAX_ASPECT_RATIO} that Qwen's processor accepts", expected=f"<= {MAX_ASPECT_RATIO}",
            observed=f"{ratio:.1f} ({width}x{height})")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > params.max_pixels:
        beta = math.sqrt(height * width / params.max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < params.min_pixels:
        beta = math.sqrt(params.min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def qwen_plan(height: int, width: int, params: QwenProcessorParams) -> ImagePlan:
    resized = smart_resize(height, width, params)
    p, m = params.patch_size, params.merge_size
    grid = (1, resized[0] // p, resized[1] // p)  # t = 1 frame / temporal_patch_size, rounded up
    return ImagePlan(original=(height, width), resized=resized, padded=resized, grid_thw=grid,
                     num_tokens=grid[1] * grid[2] // (m * m))


def mrope_positions(seq_len: int, spans: list[tuple[int, int]], plans: list[ImagePlan],
                    merge_size: int) -> tuple[np.ndarray, int]:
    """M-RoPE (3, seq) position ids and delta, as HF `get_rope_index` computes them for still images.

    Text advances all three axes by one per token; an image's tokens get (next, next + row, next + column)
    over its LLM grid, and the next text starts after the image's largest position.
    """
    pieces, next_pos, cursor = [], 0, 0
    for (start, length), plan in zip(spans, plans):
        pieces.append(np.broadcast_to(np.arange(start - cursor) + next_pos, (3, start - cursor)))
        next_pos += start - cursor
        _, h, w = plan.grid_thw
        rows, cols = np.meshgrid(np.arange(h // merge_size), np.arange(w // merge_size), indexing="ij")
        image = np.stack([np.zeros(rows.size, dtype=np.int64), rows.ravel(), cols.ravel()]) + next_pos
        pieces.append(image)
        next_pos = int(image.max()) + 1
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
        self.attention = attention
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

    def inputs(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """The tower's inputs for a batch of the host grid `grid_thw` (common.tower_inputs): the rotary positions in
        merge-window order; Qwen2.5-VL's window order and window boundaries; Qwen3-VL's bilinear taps of its
        position table. Computed here on the host by transformers' own functions."""
        from transformers.vision_utils import (get_vision_cu_seqlens, get_vision_interpolation_indices_and_weights,
                                               get_vision_position_ids, get_vision_window_index)

        tower = self.tower
        indices = {"position_ids": get_vision_position_ids(grid_thw, tower.spatial_merge_size)}
        boundaries = {"cu_seqlens": get_vision_cu_seqlens(grid_thw)}
        if self.version == "qwen2_5_vl":
            indices["window_index"], boundaries["cu_window_seqlens"] = get_vision_window_index(
                grid_thw, tower.spatial_merge_size, tower.window_size, tower.patch_size)
        if self.version == "qwen3_vl":
            indices["interp_indices"], indices["interp_weights"] = get_vision_interpolation_indices_and_weights(
                grid_thw, tower.num_grid_per_side, mode=tower.interpolation_mode,
                align_corners=tower.interpolation_align_corners, spatial_merge_size=tower.config.spatial_merge_size)
        return tower_inputs(tower, pixel_values, self.attention, indices, boundaries)

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
        self.version = _model_type(checkpoint)

    def plan(self, height: int, width: int) -> ImagePlan:
        return qwen_plan(height, width, self.params)

    def expand_image(self, plan: ImagePlan) -> tuple[list[int], list[int]]:
        start, end = self.frame_ids
        return [start] + [self.image_token_id] * plan.num_tokens + [end], [FRAME] + [IMAGE] * plan.num_tokens + [FRAME]

    def positions(self, layout: TokenLayout, plans: list[ImagePlan]) -> tuple[np.ndarray, int]:
        return mrope_positions(len(layout.input_ids), layout.image_spans, plans, self.params.merge_size)

    def reference_processor(self):
        from transformers import Qwen2VLImageProcessor

        p = self.params
        return Qwen2VLImageProcessor(
            patch_size=p.patch_size, merge_size=p.merge_size, temporal_patch_size=p.temporal_patch_size,
            size={"shortest_edge": p.min_pixels, "longest_edge": p.max_pixels},
            image_mean=list(p.image_mean), image_std=list(p.image_std))

    def load_encoder(self, device: torch.device, dtype: torch.dtype) -> QwenEncoder:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(self.checkpoint)
        self.check_image_token(config)
        _check_against_tower(self.params, config.vision_config)
        module, cls = VERSIONS[self.version]
        tower_class = getattr(importlib.import_module(module), cls)
        if self.embedding in ("tower", "both") and self.version == "qwen2_5_vl":
            raise ConfigError("model.embedding=tower/both: Qwen2.5-VL's tower keeps its features in window order; "
                              "batchvlm stores its merger tokens only (model.embedding=auto)")
        embedding = "projector" if self.embedding == "auto" else self.embedding  # the merger is the projector
        tower = load_submodule(self.checkpoint, tower_class, config.vision_config, ("model.visual.", "visual."),
                               dtype=dtype, attn_implementation=self.attn_implementation)
        return QwenEncoder(tower, embedding, self.params.merge_size, self.version,
                           self.attn_implementation).to(device).eval()

    def just_over_budget(self) -> tuple[int, int]:
        factor = self.params.factor
        return factor * 16, self.params.max_pixels // (factor * 16) + factor

    def fingerprint(self) -> dict:
        return {"family": self.name, "version": self.version, "processor": dataclasses.asdict(self.params),
                "embedding": self.embedding, "tokenizer": tokenizer_digest(self.tokenizer)}


def _check_against_tower(params: QwenProcessorParams, vision) -> None:
    """Processor parameters the tower's weights fix: a different value could only fail every record, late."""
    for ours, theirs in (("patch_size", "patch_size"), ("merge_size", "spatial_merge_size"),
                         ("temporal_patch_size", "temporal_patch_size")):
        if getattr(params, ours) != getattr(vision, theirs):
            raise ConfigError(f"model.processor.{ours}={getattr(params, ours)} but the checkpoint's tower has "
                              f"{theirs}={getattr(vision, theirs)}")


def _model_type(checkpoint: Path) -> str:
    model_type = json.loads((checkpoint / "config.json").read_text()).get("model_type")
    if model_type not in VERSIONS:
        raise ConfigError(f"model.path={checkpoint} holds a {model_type!r} checkpoint, not one of "
                          f"{', '.join(VERSIONS)}")
    return model_type


def from_config(model: ModelConfig) -> Qwen2VL:
    checkpoint, tokenizer = checkpoint_and_tokenizer(model)
    params = QwenProcessorParams.from_checkpoint(checkpoint, dict(model.processor))
    return Qwen2VL(checkpoint, params, tokenizer, model.embedding, model.attn_implementation)


# -- tiny checkpoint ---------------------------------------------------------------------------
QWEN_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>", "<|im_start|>", "<|im_end|>"]


def write_tiny_checkpoint(folder: Path) -> None:
    """Vision tower + merger + a 2-layer LLM, from a config with a fixed seed; Qwen2-VL's chat template."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessor

    tokenizer = tiny_tokenizer(QWEN_TOKENS, published_template("qwen2_vl"))
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in QWEN_TOKENS}
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=2, embed_dim=32, num_heads=2, hidden_size=64, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen2VLForConditionalGeneration(config).eval().save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    # A small max_pixels keeps the demo fast on a CPU and sends its larger photos down the shrinking branch.
    Qwen2VLImageProcessor(size={"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 256}).save_pretrained(folder)
