"""SigLIP2 NaFlex: SigLIP 2 (arXiv 2502.14786), github.com/google-research/big_vision, transformers' Siglip2 model
and Siglip2ImageProcessor.

Resize: bisect a scale so that ceil-to-patch sides fit max_num_patches (may upscale); bilinear; no
pixel padding. Rows are raster, channels last (layouts.RASTER_HWC). The tower runs packed: no
padding rows to max_num_patches; each image attends only to itself and gets its own resized
positional table. Stored: the patch tokens per image (image_embeds) and the attention-pooled vector
(pooled_embeds). Prompt: `<start_of_image>` + `<image_soft_token>` * (h*w) + `<end_of_image>`.

A clip is its sampled frames, each a NaFlex image under the clip's own patch budget (`SiglipVideoParams`), sampled by
SmolVLM2's rule (`VIDEO_RULE`); stored as an image is, frame after frame: the frames' patch tokens (video_embeds) and
one pooled vector per frame (video_pooled_embeds). Prompt: `<start_of_image>` + `<video_soft_token>` * (t*h*w) +
`<end_of_image>`, one span per clip.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from batchvlm.config import ConfigError
from batchvlm.demo import caption_corpus
from batchvlm.families import ModelConfig
from batchvlm.families.checkpoint import Layout, Rename, nontrivial, write_released
from batchvlm.families.qwen2_vl import VideoPlan
from batchvlm.families.common import (PatchFamily, checkpoint_and_tokenizer, processor_inputs,
                                      optional_token_id, processor_params, read_config, token_id,
                                      tokenizer_digest,
                                      tower_inputs)
from batchvlm.towers.attention import VARLEN, resolve_attention, varlen
from batchvlm.format.layouts import RASTER_HWC, PatchLayout
from batchvlm.records import ImagePlan
from batchvlm.format.schema import FRAME, IMAGE, VIDEO

IMAGE_TOKEN = "<image_soft_token>"
VIDEO_TOKEN = "<video_soft_token>"
FRAME_TOKENS = ("<start_of_image>", "<end_of_image>")
# The attention implementation the tower runs under once packed (registered with transformers by SiglipEncoder).
PACKED_ATTENTION = "batchvlm_packed_images"


@dataclass(frozen=True)
class SiglipProcessorParams:
    patch_size: int = 16
    max_num_patches: int = 256
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    @classmethod
    def from_checkpoint(cls, path: Path, overrides: dict) -> "SiglipProcessorParams":
        file = path / "preprocessor_config.json"
        raw = json.loads(file.read_text()) if file.exists() else {}
        values = {f.name: raw[f.name] for f in dataclasses.fields(cls) if raw.get(f.name) is not None}
        params = processor_params(cls, values, overrides, "siglip2")
        if params.max_num_patches < 1:
            raise ConfigError("model.processor.max_num_patches must be >= 1")
        return params


def naflex_size(height: int, width: int, patch_size: int, max_num_patches: int, eps: float = 1e-5) -> tuple[int, int]:
    """The largest scale (bisected, up to 100x) whose ceil-to-patch sides fit the patch budget."""
    def scaled(scale: float, size: int) -> int:
        return max(patch_size, math.ceil(size * scale / patch_size) * patch_size)

    low, high = eps / 10, 100.0
    while high - low >= eps:
        middle = (low + high) / 2
        if (scaled(middle, height) / patch_size) * (scaled(middle, width) / patch_size) <= max_num_patches:
            low = middle
        else:
            high = middle
    return scaled(low, height), scaled(low, width)


def naflex_plan(height: int, width: int, params: SiglipProcessorParams) -> ImagePlan:
    resized = naflex_size(height, width, params.patch_size, params.max_num_patches)
    grid = (1, resized[0] // params.patch_size, resized[1] // params.patch_size)
    return ImagePlan(original=(height, width), resized=resized, padded=resized, grid_thw=grid,
                     num_tokens=grid[1] * grid[2])


VIDEO_PROCESSOR_CONFIG = "video_preprocessor_config.json"

VIDEO_RULE = ("transformers SmolVLMVideoProcessor.sample_frames (SmolVLM2, SigLIP frames): fps, max_frames, skip_secs; "
              "each frame a NaFlex image of the clip's max_num_patches")
"""The one reference batchvlm samples SigLIP2 clips by. SigLIP2 ships no video processor; SmolVLM2, a SigLIP tower
reading a clip as its frames, is the one such model whose sampling transformers implements: round(fps x duration)
frames at most max_frames, linspace over the clip (its first and last skip_secs left out where the clip is long enough),
int-truncated and deduplicated. No temporal patch: one frame is a whole clip."""


@dataclass(frozen=True)
class SiglipVideoParams:
    """A clip's sampling and each frame's patch budget: SmolVLM2's sampling defaults (its released
    video_sampling: 1 fps, 64 frames), skip_secs at SmolVLMVideoProcessor's 1, and the frames' max_num_patches at the
    image processor's where the checkpoint's video_preprocessor_config.json states none."""

    fps: float = 1.0
    max_frames: int = 64
    skip_secs: float = 1.0
    max_num_patches: int = 256

    def __post_init__(self) -> None:
        if not (self.fps > 0 and self.max_frames >= 1 and self.skip_secs >= 0 and self.max_num_patches >= 1):
            raise ConfigError(f"{VIDEO_PROCESSOR_CONFIG}: fps > 0, max_frames >= 1, skip_secs >= 0 and "
                              f"max_num_patches >= 1 must hold: {self}")

    @classmethod
    def from_checkpoint(cls, path: Path, image: SiglipProcessorParams) -> "SiglipVideoParams":
        file = path / VIDEO_PROCESSOR_CONFIG
        raw = json.loads(file.read_text()) if file.exists() else {}
        values = {f.name: raw[f.name] for f in dataclasses.fields(cls) if raw.get(f.name) is not None}
        return cls(**{"max_num_patches": image.max_num_patches, **values})


def siglip_sample_frames(total: int, video_fps: float, video: SiglipVideoParams) -> list[int]:
    """SmolVLMVideoProcessor.sample_frames on a clip of `total` frames at `video_fps` (its duration total / fps, as
    transformers' VideoMetadata computes it): round(fps x duration) frames, at least 1 and at most max_frames, linspace
    between the first and the last frame, or between skip_secs from either end where the clip's duration less 2 x
    skip_secs exceeds max_frames x fps (SmolVLM's test, as written); truncated to ints, repeats removed."""
    duration = total / video_fps
    wanted = max(1, min(int(round(video.fps * duration)), video.max_frames))
    first, last = 0, total - 1
    if video.skip_secs > 0 and duration - 2 * video.skip_secs > video.max_frames * video.fps:
        first, last = int(video.skip_secs * video_fps), int(total - video.skip_secs * video_fps)
    first, last = max(0, first), min(last, total - 1)
    if first >= last:
        first, last = 0, total - 1
    return np.unique(np.linspace(first, last, wanted, dtype=int)).tolist()


def siglip_video_plan(indices: list[int], total: int, video_fps: float, height: int, width: int,
                      params: SiglipProcessorParams, video: SiglipVideoParams) -> VideoPlan:
    """Every sampled frame a NaFlex image of the clip's patch budget (the frames share one size): grid (frames, h, w),
    a token per patch of every frame."""
    frame = naflex_plan(height, width, dataclasses.replace(params, max_num_patches=video.max_num_patches))
    count = len(indices)
    grid = (count, *frame.grid_thw[1:])
    sampled_fps = count / total * video_fps
    return VideoPlan(indices=tuple(indices), resized=frame.resized, grid_thw=grid, num_tokens=math.prod(grid),
                     sampled_fps=sampled_fps, second_per_grid_t=1 / sampled_fps)


@dataclass(frozen=True)
class PackedImages:
    """What the packed attention is given in place of a mask: the images of one packed sequence, in
    sequence order (equal lengths adjacent), and the tower's own attention implementation; under
    flash_attention_2 also their boundaries on the device, made once for every layer (`tower_inputs`)."""

    lengths: tuple[int, ...]
    attention: str
    cu_seqlens: torch.Tensor | None = None

    def runs(self) -> list[tuple[int, int, int]]:
        """(first token, image count, patch count) of each run of equal lengths, in sequence order."""
        runs, start = [], 0
        for length, run in itertools.groupby(self.lengths):
            count = len(list(run))
            runs.append((start, count, length))
            start += count * length
        return runs

    def boundaries(self) -> torch.Tensor:
        """cu_seqlens on the host (int32)."""
        return torch.nn.functional.pad(torch.tensor(self.lengths).cumsum(0), (1, 0)).to(torch.int32)


def packed_attention(module, query, key, value, attention_mask: PackedImages, scaling: float, dropout: float = 0.0,
                     **kwargs):
    """Siglip2Attention's attention interface on a whole packed batch ([1, heads, tokens, head_dim]): every image
    attends only to itself. flash_attention_2 takes the image boundaries (cu_seqlens) in one varlen call; the other
    implementations run once per run of equal lengths, as a batch that needs no mask, so memory stays linear in the
    batch and the numbers are those of one tower call per patch count."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.siglip2.modeling_siglip2 import eager_attention_forward

    images = attention_mask
    if images.attention == "flash_attention_2":
        return _flash_varlen(query, key, value, images, scaling), None
    if images.attention == VARLEN:
        tokens_first = [t[0].transpose(0, 1) for t in (query, key, value)]
        return varlen(*tokens_first, images.cu_seqlens, max(images.lengths), scaling)[None], None
    attend = ALL_ATTENTION_FUNCTIONS.get_interface(images.attention, eager_attention_forward)
    outputs = []
    for start, count, length in images.runs():
        batch = [t[0, :, start:start + count * length].unflatten(1, (count, length)).transpose(0, 1)
                 for t in (query, key, value)]
        output, _ = attend(module, *batch, None, scaling=scaling, dropout=dropout, **kwargs)
        outputs.append(output.flatten(0, 1))  # [count * length, heads, head_dim]
    return torch.cat(outputs)[None], None


def _flash_varlen(query, key, value, images: PackedImages, scaling: float) -> torch.Tensor:
    from flash_attn import flash_attn_varlen_func

    longest = max(images.lengths)
    tokens_first = [t[0].transpose(0, 1) for t in (query, key, value)]  # [tokens, heads, d], flash's varlen layout
    return flash_attn_varlen_func(*tokens_first, images.cu_seqlens, images.cu_seqlens, longest, longest,
                                  softmax_scale=scaling)[None]


class SiglipEncoder(torch.nn.Module):
    """Siglip2VisionModel's own modules on a packed batch: no padding rows to max_num_patches, each image
    attending only to itself with its own resized positional table. The whole batch runs through the
    encoder in one call; only attention sees the image boundaries (`packed_attention`)."""

    def __init__(self, tower: torch.nn.Module, attention: str | None = None):
        from transformers import AttentionInterface

        super().__init__()
        # Siglip2Attention hands its attention function nothing but the mask from the encoder's caller (no
        # cu_seqlens), so the image boundaries ride in the mask argument, under an implementation of our own.
        AttentionInterface.register(PACKED_ATTENTION, packed_attention)
        self.attention = VARLEN if attention == "varlen" else tower.config._attn_implementation
        tower.config._attn_implementation = PACKED_ATTENTION
        self.tower = tower
        size = tower.config.hidden_size
        self.hidden_sizes = {"image_embeds": size}
        if tower.use_head:
            self.hidden_sizes["pooled_embeds"] = size
        self.hidden_size = size

    def embed(self, pixel_values: torch.Tensor, shapes: list[tuple[int, int]]) -> torch.Tensor:
        """Patch embeddings plus each image's positional table, resized to its grid once per distinct grid.

        The resize is the one Siglip2VisionEmbeddings.resize_positional_embeddings writes out as weights (bilinear,
        antialiased, in fp32): F.interpolate sized by host ints, where that function, given the shapes on the host,
        computes its weights there and copies them to the device with a sync per image."""
        embeddings = self.tower.embeddings
        table = embeddings.position_embedding.weight
        patches = embeddings.patch_embedding(pixel_values.to(table.dtype))
        side = embeddings.position_embedding_size
        grid = table.reshape(side, side, -1).permute(2, 0, 1)[None].float()
        resized = {shape: F.interpolate(grid, size=shape, mode="bilinear", align_corners=False, antialias=True)[0]
                   .flatten(1).T.to(table.dtype) for shape in dict.fromkeys(shapes)}
        return patches + torch.cat([resized[shape] for shape in shapes])

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> dict[str, list[torch.Tensor]]:
        """`grid_thw` on the host (the batch's planned grids), so that nothing here waits for the device. A grid of t
        frames (a clip) is t NaFlex images: its outputs are its frames' joined, t pooled vectors."""
        grids = grid_thw.tolist()
        outputs = self.frames_forward(pixel_values, [(int(h), int(w)) for t, h, w in grids for _ in range(t)])
        frames = [int(t) for t, _, _ in grids]
        if all(count == 1 for count in frames):
            return outputs
        return {name: [torch.cat(part) for part in _grouped(tensors, frames)] for name, tensors in outputs.items()}

    def frames_forward(self, pixel_values: torch.Tensor,
                       shapes: list[tuple[int, int]]) -> dict[str, list[torch.Tensor]]:
        """The packed tower on images of these (h, w) grids, in order: per image its patch tokens and pooled vector."""
        lengths = [h * w for h, w in shapes]
        # Sorted by length (stable), so that images of equal length are adjacent runs in the sequence.
        order = sorted(range(len(lengths)), key=lengths.__getitem__)
        images = PackedImages(tuple(lengths[i] for i in order), self.attention)
        pixel_values, placed = tower_inputs(self.tower, pixel_values, self.attention, {},
                                            {"cu_seqlens": images.boundaries()})
        images = dataclasses.replace(images, cu_seqlens=placed["cu_seqlens"])
        embedded = torch.split(self.embed(pixel_values, shapes), lengths)
        sequence = torch.cat([embedded[i] for i in order])[None]
        hidden = self.tower.post_layernorm(self.tower.encoder(inputs_embeds=sequence, attention_mask=images)
                                           .last_hidden_state)[0]
        tokens = dict(zip(order, torch.split(hidden, images.lengths)))
        outputs = {"image_embeds": [tokens[i] for i in range(len(lengths))]}
        if self.tower.use_head:
            pooled = dict(zip(order, self.pooled(hidden, images)))
            outputs["pooled_embeds"] = [pooled[i] for i in range(len(lengths))]
        return outputs

    def pooled(self, hidden: torch.Tensor, images: PackedImages) -> list[torch.Tensor]:
        """The attention-pooling head, one call per run of equal lengths (a batch that needs no mask); [1, hidden]
        per image, in sequence order."""
        pooled = []
        for start, count, length in images.runs():
            pooled.extend(self.tower.head(hidden[start:start + count * length].unflatten(0, (count, length))).split(1))
        return pooled


def _grouped(tensors: list[torch.Tensor], counts: list[int]) -> list[list[torch.Tensor]]:
    """Consecutive runs of `counts` tensors (a clip's frames, an image's one)."""
    starts = list(itertools.accumulate(counts, initial=0))
    return [tensors[start:stop] for start, stop in zip(starts, starts[1:])]


class Siglip2(PatchFamily):
    name = "siglip2"
    resample = "bilinear"
    frame_tokens = FRAME_TOKENS

    def __init__(self, checkpoint: Path, params: SiglipProcessorParams, tokenizer, embedding: str,
                 attn_implementation: str):
        if embedding in ("projector", "both"):
            raise ConfigError(f"model.embedding={embedding}: siglip2 has no projector; it stores the tower's patch "
                              "tokens and the pooled embedding (model.embedding=auto or tower)")
        super().__init__(checkpoint, params, tokenizer, embedding, attn_implementation,
                         PatchLayout(RASTER_HWC, params.patch_size), IMAGE_TOKEN)
        self.frame_ids = [token_id(tokenizer, token, self.name) for token in FRAME_TOKENS]
        self.video_token_id = _video_token_id(tokenizer)
        self.video_params = SiglipVideoParams.from_checkpoint(checkpoint, params)

    @property
    def video_rule(self) -> str | None:
        """VIDEO_RULE where the tokenizer has the clip token; None otherwise: the family then takes no clip."""
        return VIDEO_RULE if self.video_token_id is not None else None

    def video_sampler(self) -> functools.partial:
        """(frames in a clip, its fps) -> the frames sampled, picklable for the decoder's child."""
        return functools.partial(siglip_sample_frames, video=self.video_params)

    def plan_video(self, indices: list[int], total: int, video_fps: float, height: int, width: int,
                   times: list[float] | None = None) -> VideoPlan:
        """A clip's frames as NaFlex images of its patch budget (their pts `times` are stored by the clip itself)."""
        return siglip_video_plan(indices, total, video_fps, height, width, self.params, self.video_params)

    def expand_video(self, plan: VideoPlan) -> tuple[list[int], list[int]]:
        """One span per clip, its frames' patches in frame order: `<start_of_image>` + `<video_soft_token>` * (t*h*w)
        + `<end_of_image>`."""
        start, end = self.frame_ids
        return [start] + [self.video_token_id] * plan.num_tokens + [end], [FRAME] + [VIDEO] * plan.num_tokens + [FRAME]

    def video_fingerprint(self) -> dict | None:
        """The clip rule and its parameters as the checkpoint gives them; None: no clip taken."""
        if self.video_rule is None:
            return None
        return {"rule": self.video_rule, "params": dataclasses.asdict(self.video_params)}

    def plan(self, height: int, width: int) -> ImagePlan:
        return naflex_plan(height, width, self.params)

    def expand_image(self, plan: ImagePlan) -> tuple[list[int], list[int]]:
        start, end = self.frame_ids
        return [start] + [self.image_token_id] * plan.num_tokens + [end], [FRAME] + [IMAGE] * plan.num_tokens + [FRAME]

    def reference_processor(self, max_num_patches: int | None = None):
        from transformers import Siglip2ImageProcessor

        p = self.params
        return Siglip2ImageProcessor(patch_size=p.patch_size, max_num_patches=max_num_patches or p.max_num_patches,
                                     image_mean=list(p.image_mean), image_std=list(p.image_std))

    def reference_preprocess(self, images: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        """The processor's padded output, cut back to each image's real rows (the packed layout)."""
        out = self.reference_processor()(images=processor_inputs(images), return_tensors="pt")
        rows = [values[:int(h) * int(w)] for values, (h, w) in zip(out["pixel_values"], out["spatial_shapes"])]
        grids = torch.cat([torch.ones(len(rows), 1, dtype=torch.int64), out["spatial_shapes"].long()], dim=1)
        return torch.cat(rows), grids

    def reference_clip_rows(self, frames: np.ndarray, plan: VideoPlan) -> torch.Tensor:
        """A clip's rows from Siglip2ImageProcessor at the clip's patch budget (the clip parity oracle): each frame a
        NaFlex image, its padded rows cut to the frame's."""
        out = self.reference_processor(self.video_params.max_num_patches)(images=processor_inputs(list(frames)),
                                                                           return_tensors="pt")
        return torch.cat([values[:int(h) * int(w)] for values, (h, w) in zip(out["pixel_values"],
                                                                             out["spatial_shapes"])])

    def load_encoder(self, device: torch.device, dtype: torch.dtype) -> SiglipEncoder:
        """On the meta device: the header check alone, no tensor read (what batchvlm-estimate runs)."""
        vision_config = hf_vision_config(read_config(self.checkpoint), self.checkpoint)
        if vision_config.patch_size != self.params.patch_size:
            raise ConfigError(f"{self.checkpoint}: the tower's patch_size={vision_config.patch_size} but the processor's "
                              f"is {self.params.patch_size}")
        parts, checked = self.load_parts(vision_parts, device, dtype)
        encoder = SiglipEncoder(parts[TOWER], resolve_attention(self.attention, device, dtype)).to(device).eval()
        encoder.checked = checked
        return encoder

    def just_over_budget(self) -> tuple[int, int]:
        side, p = math.isqrt(self.params.max_num_patches), self.params.patch_size
        return p * side, p * side + 1  # one pixel over the patch budget

    def fingerprint(self) -> dict:
        return {"family": self.name, "processor": dataclasses.asdict(self.params), "embedding": self.embedding,
                "tokenizer": tokenizer_digest(self.tokenizer)}


def _video_token_id(tokenizer) -> int | None:
    """The tokenizer's `<video_soft_token>` (SigLIP2's released tokenizer has none, nor any image token: a tokenizer
    with them is given by model.tokenizer_path); None without it."""
    return optional_token_id(tokenizer, VIDEO_TOKEN)


def from_config(model: ModelConfig) -> Siglip2:
    checkpoint, tokenizer = checkpoint_and_tokenizer(model)
    params = SiglipProcessorParams.from_checkpoint(checkpoint, dict(model.processor))
    return Siglip2(checkpoint, params, tokenizer, model.embedding, model.attn_implementation)


# -- the checkpoint: config.json's fields, the tensors' names ------------------------------------
TOWER = "vision_model."
MODEL_TYPES = ("siglip2", "siglip2_vision_model")
"""Google's release is the two-tower model (siglip2); transformers also saves the vision model alone."""
ROOTS = ("embeddings.", "encoder.", "post_layernorm.", "head.")
LAYOUTS = (Layout("released", (TOWER,), (Rename(TOWER, TOWER),)),
           Layout("transformers", ROOTS, tuple(Rename(root, TOWER + root) for root in ROOTS)))
"""Google releases the vision tower under vision_model.* (beside text_model.*); transformers 5 saves the vision model
alone without that prefix."""


def hf_vision_config(raw: dict, path: Path):
    """transformers' Siglip2VisionConfig of a checkpoint's config.json: its vision_config, or the whole file for a
    vision model saved alone."""
    from transformers import Siglip2VisionConfig

    model_type = raw.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ConfigError(f"model.path={path} holds a {model_type!r} checkpoint, not {' or '.join(MODEL_TYPES)}")
    vision = raw if model_type == "siglip2_vision_model" else raw.get("vision_config") or {}
    return Siglip2VisionConfig(**{key: value for key, value in vision.items() if key != "model_type"})


def vision_parts(raw: dict, path: Path, dtype: torch.dtype = torch.float32,
                 attention: str = "sdpa") -> tuple[dict[str, torch.nn.Module], tuple[Layout, ...]]:
    """The vision model transformers runs, built from config.json (its init is overwritten by the load), and the
    layouts its tensors are stored in, the released one first."""
    from transformers import Siglip2VisionModel

    tower = Siglip2VisionModel._from_config(hf_vision_config(raw, path), dtype=dtype, attn_implementation=attention)
    return {TOWER: tower}, LAYOUTS


# -- tiny checkpoint ---------------------------------------------------------------------------
SIGLIP_TOKENS = ["<start_of_image>", "<image_soft_token>", "<end_of_image>", VIDEO_TOKEN]


TINY_TOWER = dict(hidden_act="gelu_pytorch_tanh", hidden_size=32, intermediate_size=64, num_attention_heads=2,
                  num_hidden_layers=2)


def released_config(vocab_size: int) -> dict:
    """config.json as Google releases SigLIP2's NaFlex checkpoints (both towers), tiny."""
    return {"architectures": ["Siglip2Model"], "initializer_factor": 1.0, "model_type": "siglip2",
            "text_config": dict(TINY_TOWER, model_type="siglip2_text_model", projection_size=32,
                                vocab_size=vocab_size, pad_token_id=0, eos_token_id=1, bos_token_id=2),
            "torch_dtype": "float32",
            "vision_config": dict(TINY_TOWER, model_type="siglip2_vision_model", num_patches=256, patch_size=16)}


def demo_tokenizer():
    """A small BPE that splits text as SigLIP2's does (Gemma's, lowercased: transformers loads a siglip2 checkpoint's
    tokenizer as its Siglip2Tokenizer whatever the files say), trained on the demo captions, with the image tokens
    (which SigLIP2's config.json names no id of)."""
    import string

    from tokenizers import Tokenizer, models, normalizers, trainers
    from transformers import Siglip2Tokenizer

    core = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    core.normalizer = normalizers.Sequence([normalizers.Lowercase(), normalizers.Replace(" ", "▁")])
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<pad>", "<eos>", "<bos>", "<unk>", "<mask>",
                                                                  *SIGLIP_TOKENS],
                                  initial_alphabet=[*string.printable.lower(), "▁"], show_progress=False)
    core.train_from_iterator(caption_corpus(), trainer=trainer)
    model = json.loads(core.to_str())["model"]
    return Siglip2Tokenizer(vocab=model["vocab"], merges=[tuple(merge) for merge in model["merges"]],
                            extra_special_tokens=SIGLIP_TOKENS)


def write_tiny_checkpoint(folder: Path) -> None:
    """A NaFlex vision tower with its attention-pooling head, beside a text tower, as Google releases them (config.json,
    names), from a config with a fixed seed."""
    from transformers import Siglip2ImageProcessor

    tokenizer = demo_tokenizer()
    write_checkpoint(folder, released_config(len(tokenizer)))
    tokenizer.save_pretrained(folder)
    Siglip2ImageProcessor(patch_size=16, max_num_patches=256).save_pretrained(folder)


def write_checkpoint(folder: Path, config: dict, language_model: bool = True, seed: int = 0) -> None:
    """A checkpoint of `config` (config.json as released) in the released layout, every tensor of non-trivial values,
    deterministic; with `language_model`, its text tower too, which the job never reads."""
    from transformers import Siglip2Config, Siglip2Model

    torch.manual_seed(seed)
    text = {}
    if language_model:
        model = nontrivial(Siglip2Model(Siglip2Config(**config)), seed)
        parts = {TOWER: model.vision_model}
        text = {name: tensor for name, tensor in model.state_dict().items() if not name.startswith(TOWER)}
    else:
        parts = {prefix: nontrivial(part, seed) for prefix, part in vision_parts(config, folder)[0].items()}
    write_released(folder, config, LAYOUTS[0], parts, text)
