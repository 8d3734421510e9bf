"""Kimi-K2.5 / K3-style MoonViT (NaViT packing): Kimi-VL (arXiv 2504.07491), moonshotai/Kimi-K2.5 on the Hugging Face
Hub, transformers' Kimi_K25 model and image processor.

Resize: scale down to a patch budget (never up), truncate, pad bottom/right to a multiple of
merge*patch. Patches (N, C, p, p) in raster order; the tower merges 2x2 itself. Prompt: K3 framing
`<|media_begin|>image {W}x{H}<|media_content|>` + pad * n + `<|media_end|>`, or K2.5's bare repeat.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from batchvlm.config import ConfigError
from batchvlm.families import ModelConfig
from batchvlm.devices import to_device
from batchvlm.families.common import (PatchFamily, checkpoint_and_tokenizer, choose_projector, processor_params,
                                      published_template, tiny_tokenizer, token_id, tokenizer_digest,
                                      tower_inputs)
from batchvlm.format.layouts import RASTER_CHW, PatchLayout
from batchvlm.records import ImagePlan
from batchvlm.format.schema import FRAME, IMAGE

IMAGE_TOKEN = "<|media_pad|>"
FRAME_TOKENS = ("<|media_begin|>", "<|media_content|>", "<|media_end|>")


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


class KimiEncoder(torch.nn.Module):
    """MoonViT tower (+ projector): packed (N, C, p, p) patches and grids in, per-image tokens out."""

    def __init__(self, tower: torch.nn.Module, projector: torch.nn.Module | None, merge_size: int, keep_tower: bool,
                 attention: str):
        super().__init__()
        self.tower = tower
        self.attention = attention
        self.projector = projector
        self.merge_area = merge_size * merge_size
        self.keep_tower = keep_tower
        tower_size = tower.config.hidden_size * self.merge_area
        self.hidden_sizes = {"image_embeds": projector.out_proj.out_features if projector is not None else tower_size}
        if keep_tower:
            self.hidden_sizes["tower_embeds"] = tower_size
        self.hidden_size = self.hidden_sizes["image_embeds"]

    def inputs(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """The tower's inputs for a batch of the host grid `grid_thw`: what MoonViT computes from the grid (rotary
        positions, the bicubic taps of its position table, frame indices, the 2x2 merge's scatter index), computed
        here on the host by transformers' own functions (common.tower_inputs)."""
        from transformers.models.kimi_k25.modeling_kimi_k25 import (get_vision_frame_index,
                                                                    get_vision_temporal_merge_index)
        from transformers.vision_utils import (get_vision_cu_seqlens, get_vision_interpolation_indices_and_weights,
                                               get_vision_position_ids)

        table = self.tower.patch_embed.pos_emb
        taps = get_vision_interpolation_indices_and_weights(grid_thw, table.num_grid_per_side,
                                                            mode=table.interpolation_mode,
                                                            align_corners=table.interpolation_align_corners)
        indices = {"position_ids": get_vision_position_ids(grid_thw, spatial_merge_size=1),
                   "interp_indices": taps[0], "interp_weights": taps[1],
                   "frame_index": get_vision_frame_index(grid_thw),
                   "temporal_merge_index": get_vision_temporal_merge_index(grid_thw, *self.tower.merge_kernel_size)}
        return tower_inputs(self.tower, pixel_values, self.attention, indices,
                            {"cu_seqlens": get_vision_cu_seqlens(grid_thw, merge_temporal=True)})

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

    # -- pixels ---------------------------------------------------------------------------------
    def reference_processor(self):
        from transformers import Kimi_K25ImageProcessor

        p = self.params
        return Kimi_K25ImageProcessor(
            patch_size=p.patch_size, merge_size=p.merge_size, max_patches=p.max_patches,
            size={"max_height": p.max_patches_per_side, "max_width": p.max_patches_per_side},
            image_mean=list(p.image_mean), image_std=list(p.image_std))

    # -- tower ----------------------------------------------------------------------------------
    def load_encoder(self, device: torch.device, dtype: torch.dtype) -> KimiEncoder:
        from transformers import AutoConfig, Kimi_K25VisionModel

        config = AutoConfig.from_pretrained(self.checkpoint)
        kwargs = dict(dtype=dtype, attn_implementation=self.attn_implementation, use_safetensors=True)
        if config.model_type == "kimi_k25_vision":
            tower, projector = Kimi_K25VisionModel.from_pretrained(self.checkpoint, **kwargs), None
        elif config.model_type == "kimi_k25":
            self.check_image_token(config)
            tower, projector = _tower_and_projector(self.checkpoint, config, kwargs)
        else:
            raise ConfigError(f"model.path={self.checkpoint} holds a {config.model_type!r} checkpoint, "
                              "not kimi_k25 or kimi_k25_vision")
        projector = choose_projector(self.embedding, projector)
        return KimiEncoder(tower, projector, self.params.merge_size, self.embedding == "both",
                           self.attn_implementation).to(device).eval()

    def just_over_budget(self) -> tuple[int, int]:
        side, p = math.isqrt(self.params.max_patches), self.params.patch_size
        return p * side, p * (side + 1)  # one column of patches over max_patches

    def fingerprint(self) -> dict:
        return {"family": self.name, "processor": dataclasses.asdict(self.params), "framing": self.framing,
                "embedding": self.embedding, "tokenizer": tokenizer_digest(self.tokenizer)}


def _tower_and_projector(checkpoint: Path, config, kwargs: dict):
    """The checkpoint's tower and projector, through transformers' own weight conversion (Moonshot's names,
    fused qkv), with a language model of no layers and a one-token vocabulary: a 1T-parameter checkpoint
    costs only its vision weights in memory; the LLM's tensors are skipped as unexpected or mismatched."""
    from transformers import Kimi_K25ForConditionalGeneration
    from transformers.utils import logging as hf_logging

    config.text_config.num_hidden_layers = 0
    config.text_config.vocab_size = 1
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its load report lists every skipped LLM tensor, on purpose skipped
    try:
        full = Kimi_K25ForConditionalGeneration.from_pretrained(checkpoint, config=config,
                                                                ignore_mismatched_sizes=True, **kwargs)
    finally:
        hf_logging.set_verbosity(verbosity)
    return full.model.vision_tower, full.model.mm_projector


def from_config(model: ModelConfig, family_class: type[KimiK25] = KimiK25) -> KimiK25:
    """The family (or a subclass that states its own difference, as a user's MoonViT family may) of a checkpoint."""
    checkpoint, tokenizer = checkpoint_and_tokenizer(model)
    params = KimiProcessorParams.from_checkpoint(checkpoint, dict(model.processor))
    return family_class(checkpoint, params, tokenizer, model.framing, model.embedding, model.attn_implementation)


# -- tiny checkpoint ---------------------------------------------------------------------------
MEDIA_TOKENS = ["<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>",
                "<|kimi_k25_video_placeholder|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
                "<|im_end|>"]

TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                        pos_emb_height=16, pos_emb_width=16)
BASE_VISION = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                        pos_emb_height=64, pos_emb_width=64)
"""A ViT-B-sized MoonViT for the end-to-end benchmark, where the tower must cost what a real one does."""


def write_tiny_checkpoint(folder: Path, vision: dict = TINY_VISION) -> None:
    """MoonViT tower + projector + a one-layer MoE LLM, from a config with a fixed seed; Kimi-K2.5's chat template."""
    from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration, Kimi_K25ImageProcessor

    tokenizer = tiny_tokenizer(MEDIA_TOKENS, published_template("kimi_k25"))
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in MEDIA_TOKENS}
    config = Kimi_K25Config(
        text_config=dict(model_type="deepseek_v3", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         moe_intermediate_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
                         n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                         kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                         max_position_embeddings=8192, n_group=1, topk_group=1),
        vision_config=dict(**vision, patch_size=14, rope_parameters={"rope_type": "axial", "rope_theta": 10000.0}),
        projection_hidden_size=vision["hidden_size"], image_token_id=ids["<|media_pad|>"],
        video_token_id=ids["<|kimi_k25_video_placeholder|>"], vision_start_token_id=ids["<|media_begin|>"],
        vision_end_token_id=ids["<|media_end|>"], tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Kimi_K25ForConditionalGeneration(config).eval()
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    Kimi_K25ImageProcessor(patch_size=14, merge_size=2, max_patches=16384,
                           size={"max_height": 512, "max_width": 512}).save_pretrained(folder)


def write_base_checkpoint(folder: Path) -> None:
    """The tiny checkpoint with a ViT-B-sized tower (BASE_VISION)."""
    write_tiny_checkpoint(folder, BASE_VISION)
