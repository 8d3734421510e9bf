"""Encoder families: the `Family` protocol, and finding a family's module by name.

A family is one module and one YAML under conf/model/. The module states only the family's own rules (common.py
holds what they share) and answers to the module-level names below; `model.family` names a module of this package
(`kimi_k25`), or any importable module by its dotted path, so that a user's own family plugs in without editing
batchvlm:

    from_config(model: ModelConfig) -> Family   the family, with its checkpoint and tokenizer
    write_tiny_checkpoint(folder: Path) -> None  optional: a tiny checkpoint built from a config with a fixed seed,
                                                 which the demo and the tests use where `model.path` is null
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar, Protocol

import numpy as np
import torch

from batchvlm.config import Choice, Config, ConfigError, operational, read_from, written
from batchvlm.demo import DEMO_VERSION, build_once, home
from batchvlm.format.layouts import PatchLayout
from batchvlm.format.schema import Dtype
from batchvlm.records import ImagePlan, TokenLayout

class Attention(Choice):
    auto = "auto"
    varlen = "varlen"
    sdpa = "sdpa"
    eager = "eager"
    flash_attention_2 = "flash_attention_2"


FLASH_ATTENTION = Attention.flash_attention_2


class Embedding(Choice):
    auto = "auto"
    projector = "projector"
    tower = "tower"
    both = "both"


class Framing(Choice):
    k3 = "k3"
    plain = "plain"


TINY = "tiny"
"""model.path of the family's tiny checkpoint, built on first use: the demo's, never a real model."""


@dataclass
class ModelConfig(Config):
    KEY: ClassVar[str] = "model"

    family: str = written("kimi_k25")
    """Encoder family module under batchvlm/families/, or the dotted path of a module of your own."""
    path: str = read_from(TINY)
    """Local checkpoint folder (safetensors), or `tiny`: the family's tiny demo checkpoint, built on first use. Required
    in a job's config: only the *_tiny model configs name `tiny` (the Python default is the demo's). Its config and
    weights digests are in the run's fingerprint."""
    tokenizer_path: str | None = read_from(None)
    """Tokenizer folder when it is not the checkpoint's own (its digest is in the fingerprint)."""
    dtype: Dtype = written(Dtype.float32)
    """Compute dtype of the tower: float32 | bfloat16 | float16 (flash_attention_2 needs one of the last two)."""
    device: str = operational("auto")
    """auto (cuda when available, else cpu) | cpu | cuda | cuda:N."""
    attn_implementation: Attention = written(Attention.auto)
    """auto (varlen on CUDA in bfloat16/float16 where torch has it, sdpa otherwise; the fingerprint holds the choice
    made) | varlen (one call per layer over the packed batch, torch's varlen flash attention) | sdpa | eager |
    flash_attention_2 (the flash_attn package): the same math, but not the same bits in half precision."""
    embedding: Embedding = written(Embedding.auto)
    """Which output is stored as image_embeds: auto (the projector's LLM-ready tokens where the checkpoint has a
    projector, the tower's tokens otherwise) | projector | tower | both (projector tokens, plus the tower's in
    tower_embeds)."""
    framing: Framing = written(Framing.k3)
    """kimi_k25 prompt contract: k3 (begin/content/end frame around each image's tokens) | plain (bare repeats, K2.5).
    Other families have one contract each and ignore it."""
    trust_remote_code: bool = operational(False)
    chat_template: str | None = read_from(None)
    """A Jinja chat template file rendering conversations in place of the tokenizer's own (dataset.format other than
    text); each image must render as the family's single image token. Its digest is in the fingerprint."""
    processor: dict[str, Any] = written(factory=dict)
    """Overrides of the checkpoint's processor parameters (family-specific keys, validated by the family)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.path:
            raise ConfigError(f"model.path={self.path!r}: give a local checkpoint folder, or tiny for the demo's")
        if self.attn_implementation == FLASH_ATTENTION and self.dtype == Dtype.float32:
            raise ConfigError(f"model.attn_implementation={FLASH_ATTENTION} runs in float16 or bfloat16 only, and "
                              "model.dtype=float32: set model.dtype=bfloat16 (or float16), or "
                              "model.attn_implementation=sdpa")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigError(f"model.device={self.device!r} is not one of auto, cpu, cuda, cuda:N")
        if self.chat_template is not None and not Path(self.chat_template).is_file():
            raise ConfigError(f"model.chat_template={self.chat_template!r} is not a file")


SHARED = ("common", "checkpoint")
"""The modules of this package that are no family: what the families share, and how they load checkpoints."""


class Encoder(Protocol):
    hidden_size: int  # of image_embeds
    hidden_sizes: dict[str, int]  # of every output it returns

    def __call__(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> dict[str, list[torch.Tensor]]:
        """Run the tower on a packed batch; return per output name (`image_embeds` and any of
        format.schema.EXTRA_OUTPUTS) one tensor per image: [num_tokens_i, hidden], pooled ones [1, hidden]."""


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

    def just_over_budget(self) -> tuple[int, int]:
        """(height, width) of an image one step over the family's patch or pixel budget: where its size rule
        starts to shrink images, the edge its plan must agree with the HF processor on."""


def family_names() -> list[str]:
    """The families batchvlm ships: every module of this package but the shared ones."""
    return sorted(module.name for module in pkgutil.iter_modules(__path__) if module.name not in SHARED)


def family_module(name: str) -> ModuleType:
    """The module of `model.family`: one of this package by name, else an importable module by its dotted path."""
    qualified = f"{__name__}.{name}" if name in family_names() else name
    if name in SHARED or not qualified:
        raise ConfigError(f"model.family={name!r} is not a family (known: {', '.join(family_names())})")
    try:
        module = importlib.import_module(qualified)
    except ModuleNotFoundError as error:
        if error.name is None or not qualified.startswith(error.name):
            raise  # the family's module imports something that is missing: say that, not "no such family"
        raise ConfigError(f"model.family={name!r} is neither one of {', '.join(family_names())} nor an importable "
                          "module") from None
    if not callable(getattr(module, "from_config", None)):
        raise ConfigError(f"model.family={name!r}: the module {module.__name__} has no from_config(model) -> Family")
    return module


def load_family(model: ModelConfig) -> Family:
    return family_module(model.family).from_config(model)


def check_checkpoint(family: Family, dtype: torch.dtype) -> tuple[dict[str, int], str]:
    """The widths of the family's outputs and what its checkpoint holds, from config.json and the safetensors headers
    alone: the encoder built on the meta device, no tensor read. A checkpoint the job would refuse is refused here,
    by the same check (families/checkpoint.py)."""
    encoder = family.load_encoder(torch.device("meta"), dtype)
    checked = getattr(encoder, "checked", None)  # a user's family may load its weights its own way
    return encoder.hidden_sizes, checked.describe() if checked else "not checked (the family loads it its own way)"


def tiny_checkpoint(name: str) -> Path:
    """The family's tiny checkpoint, built on first use (once, whatever the number of processes asking)."""
    module = family_module(name)
    write = getattr(module, "write_tiny_checkpoint", None)
    if write is None:
        raise ConfigError(f"model.path is required: the family {name!r} builds no tiny checkpoint")
    return build_once(home() / f"demo-{DEMO_VERSION}" / f"{name}_tiny", write)


def resolve_checkpoint(model: ModelConfig) -> Path:
    """The local checkpoint folder: model.path, or the family's tiny one (model.path=tiny)."""
    if model.path == TINY:
        return tiny_checkpoint(model.family)
    path = Path(model.path)
    if not (path / "config.json").exists():
        raise ConfigError(f"model.path={model.path!r} is not a checkpoint folder (no config.json); "
                          "batchvlm reads local checkpoints only")
    if not any(path.glob("*.safetensors")):
        found = ", ".join(sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth"))) or "none"
        raise ConfigError(f"model.path={model.path!r} holds no safetensors weights (weights found: {found}); "
                          "batchvlm reads safetensors only and never unpickles a checkpoint: convert it first")
    return path


def full_model(checkpoint: str | Path, model_class=None, **kwargs):
    """transformers' own model of the whole checkpoint, its language model included (what a trainer trains), by
    `model_class.from_pretrained` (AutoModelForImageTextToText by default), which maps the stored names itself.

    Kimi's released config.json names the tower's dims as transformers does not read them (`vt_*`,
    `init_pos_emb_*`): the family's reading of them (kimi_k25.hf_config) is handed over as the config."""
    import json

    from transformers import AutoModelForImageTextToText

    from batchvlm.families import kimi_k25

    raw = json.loads((Path(checkpoint) / "config.json").read_text())
    if raw.get("model_type") == "kimi_k25":
        kwargs["config"] = kimi_k25.hf_config(raw, Path(checkpoint))
    return (model_class or AutoModelForImageTextToText).from_pretrained(checkpoint, **kwargs)
