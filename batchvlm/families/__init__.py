"""Encoder families: each module states only its own rules, behind the `Family` protocol.

Adding a family means adding one module here, one entry in `FAMILIES` and one config file.
"""

from __future__ import annotations

import importlib
from typing import Protocol

import numpy as np
import torch

from batchvlm.config import ConfigError, ModelConfig
from batchvlm.layouts import PatchLayout
from batchvlm.records import ImagePlan


class Encoder(Protocol):
    hidden_size: int

    def __call__(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        """Run the tower on a packed batch; return one [num_tokens_i, hidden] tensor per image."""


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

    def fingerprint(self) -> dict:
        """Everything about the family's processing that changes the output."""


FAMILIES = {"kimi_k25": "batchvlm.families.kimi_k25"}


def load_family(model: ModelConfig) -> Family:
    if model.family not in FAMILIES:
        raise ConfigError(f"model.family={model.family!r} is not one of {', '.join(FAMILIES)}")
    module = importlib.import_module(FAMILIES[model.family])
    return module.from_config(model)
