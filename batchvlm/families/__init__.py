"""Encoder families: each module states only its own rules, behind the `Family` protocol.

Adding a family means adding one module here, one entry in `FAMILIES`, a config file per checkpoint
kind (and a tiny one), a tiny checkpoint builder in `demo.TINY_CHECKPOINTS`, and its name in the tests'
`FAMILY_NAMES`, which a test keeps in step with `FAMILIES`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from batchvlm.config import ConfigError, ModelConfig
from batchvlm.format.layouts import PatchLayout
from batchvlm.records import ImagePlan, TokenLayout


class Encoder(Protocol):
    hidden_size: int  # of image_embeds
    hidden_sizes: dict[str, int]  # of every output it returns

    def __call__(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> dict[str, list[torch.Tensor]]:
        """Run the tower on a packed batch; return per output name (`image_embeds` and any of
        encode.EXTRA_OUTPUTS) one tensor per image: [num_tokens_i, hidden], pooled ones [1, hidden]."""


class Family(Protocol):
    name: str
    image_token_id: int
    resample: str  # torch interpolate mode of the family's processor
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    layout: PatchLayout  # the row layout every preprocessing backend writes

    def plan(self, height: int, width: int) -> ImagePlan:
        """Resized size, padded size, grid and token count of an image, by the family's size rule."""

    def expand_image(self, plan: ImagePlan) -> tuple[list[int], list[int]]:
        """Token ids (and their tags) that replace one image placeholder."""

    def encode_text(self, text: str) -> list[int]:
        """Token ids of a run of plain text, with the checkpoint's own tokenizer."""

    def patchify(self, image: torch.Tensor) -> torch.Tensor:
        """Normalized CHW float image at its padded size -> rows in the tower's patch layout."""

    def grid_of(self, image: torch.Tensor) -> tuple[int, int, int]:
        """The grid a preprocessed CHW image actually has (measured, not planned)."""

    def reference_preprocess(self, images: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        """pixel_values and grid_thw from the family's Hugging Face image processor (the oracle)."""

    def load_encoder(self, device: torch.device, dtype: torch.dtype) -> Encoder:
        """The tower (and projector where the checkpoint has one) from the local checkpoint."""

    def positions(self, layout: TokenLayout, plans: list[ImagePlan]) -> tuple[np.ndarray, int] | None:
        """Position ids [3, seq] and rope delta where the family's LLM uses M-RoPE; None otherwise."""

    def fingerprint(self) -> dict:
        """Everything about the family's processing that changes the output."""


FAMILIES = {"kimi_k25": "batchvlm.families.kimi_k25", "qwen2_vl": "batchvlm.families.qwen2_vl",
            "siglip2": "batchvlm.families.siglip2"}


class PatchFamily:
    """What every family does the same way, given its checkpoint, processor parameters and tokenizer."""

    name: str

    def __init__(self, checkpoint: Path, params, tokenizer, embedding: str, attn_implementation: str,
                 layout: PatchLayout, image_token: str):
        self.checkpoint = checkpoint
        self.params = params
        self.tokenizer = tokenizer
        self.embedding = embedding
        self.attn_implementation = attn_implementation
        self.layout = layout
        self.image_token_id = token_id(tokenizer, image_token, self.name)

    @property
    def image_mean(self) -> tuple[float, float, float]:
        return self.params.image_mean

    @property
    def image_std(self) -> tuple[float, float, float]:
        return self.params.image_std

    def encode_text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    def patchify(self, image: torch.Tensor) -> torch.Tensor:
        return self.layout.patchify(image)

    def grid_of(self, image: torch.Tensor) -> tuple[int, int, int]:
        _, h, w = image.shape
        p = self.layout.patch_size
        # True division: a size that is not a whole number of patches shows up as a fraction.
        return (1, h / p, w / p)

    def positions(self, layout: TokenLayout, plans: list[ImagePlan]) -> tuple[np.ndarray, int] | None:
        return None

    def reference_preprocess(self, images: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.reference_processor()(images=processor_inputs(images), return_tensors="pt")
        return out["pixel_values"], out["image_grid_thw"]

    def check_image_token(self, config) -> None:
        """The checkpoint's LLM must read image embeddings where this tokenizer puts the image token."""
        if config.image_token_id != self.image_token_id:
            raise ConfigError(f"{self.checkpoint}: config image_token_id={config.image_token_id} but the tokenizer "
                              f"maps its image token to {self.image_token_id} (model.tokenizer_path)")


def processor_params(cls, values: dict, overrides: dict, family: str):
    """A family's processor parameters: the checkpoint's values, then the model.processor overrides."""
    known = {f.name for f in dataclasses.fields(cls)}
    for key in overrides:
        if key not in known:
            raise ConfigError(f"model.processor.{key} is not a {family} processor parameter "
                              f"(known: {', '.join(sorted(known))})")
    values = {**values, **overrides}
    params = cls(**{k: tuple(v) if k.startswith("image_") else int(v) for k, v in values.items()})
    if any(s == 0 for s in params.image_std):
        raise ConfigError("model.processor.image_std: image normalization standard deviation must be nonzero")
    return params


def checkpoint_and_tokenizer(model: ModelConfig):
    """The local checkpoint folder (the tiny demo one when model.path is null) and its tokenizer."""
    from transformers import AutoTokenizer

    from batchvlm.demo import resolve_checkpoint

    checkpoint = resolve_checkpoint(model)
    tokenizer = AutoTokenizer.from_pretrained(model.tokenizer_path or checkpoint,
                                              trust_remote_code=model.trust_remote_code)
    return checkpoint, tokenizer


def processor_inputs(images: list[np.ndarray]) -> list[torch.Tensor]:
    """HWC uint8 images as the CHW RGB tensors HF processors take (the oracle sees no alpha)."""
    return [torch.from_numpy(np.ascontiguousarray(image[..., :3])).permute(2, 0, 1) for image in images]


def token_id(tokenizer, token: str, family: str) -> int:
    found = tokenizer.convert_tokens_to_ids(token)
    if found is None or found == tokenizer.unk_token_id or tokenizer.convert_ids_to_tokens(found) != token:
        raise ConfigError(f"the tokenizer has no {token} token; {family} needs it (model.tokenizer_path)")
    return found


def tokenizer_digest(tokenizer) -> str:
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]


def choose_projector(embedding: str, projector: torch.nn.Module | None) -> torch.nn.Module | None:
    """The projector to run for model.embedding: auto uses it where the checkpoint has one."""
    if embedding == "tower":
        return None
    if projector is None and embedding in ("projector", "both"):
        raise ConfigError(f"model.embedding={embedding} but the checkpoint has no projector; "
                          "use model.embedding=tower (or auto)")
    return projector


def load_submodule(checkpoint: Path, module_class, config, prefixes: tuple[str, ...], dtype: torch.dtype,
                   attn_implementation: str) -> torch.nn.Module:
    """Build one part of a checkpoint (the vision tower) from its sub-config and read only its weights.

    The language model of a VLM checkpoint is most of its bytes; only the shards that hold the part's
    tensors are opened, and only those tensors are read.
    """
    from safetensors import safe_open

    module = module_class._from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    index = checkpoint / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        shards = sorted({shard for key, shard in weight_map.items() if key.startswith(prefixes)})
    else:
        shards = ["model.safetensors"]
    state = {}
    for shard in shards:
        with safe_open(checkpoint / shard, framework="pt") as tensors:
            for key in tensors.keys():
                prefix = next((p for p in prefixes if key.startswith(p)), None)
                if prefix is not None:
                    state[key[len(prefix):]] = tensors.get_tensor(key)
    missing, unexpected = module.load_state_dict(state, strict=False)
    if missing or unexpected or not state:
        raise ConfigError(f"{checkpoint}: the weights under {' or '.join(prefixes)} do not fit "
                          f"{module_class.__name__} (missing {missing[:3]}, unexpected {unexpected[:3]})")
    return module.to(dtype)


def load_family(model: ModelConfig) -> Family:
    if model.family not in FAMILIES:
        raise ConfigError(f"model.family={model.family!r} is not one of {', '.join(FAMILIES)}")
    module = importlib.import_module(FAMILIES[model.family])
    return module.from_config(model)
