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
from pathlib import Path
from types import ModuleType
from typing import Protocol

import numpy as np
import torch

from batchvlm.config import TINY, ConfigError, ModelConfig
from batchvlm.demo import DEMO_VERSION, build_once, home
from batchvlm.format.layouts import PatchLayout
from batchvlm.records import ImagePlan, TokenLayout

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
