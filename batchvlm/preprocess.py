"""Preprocessing: decoded images of many records -> one packed pixel tensor in the tower's layout.

Backends: `torch` (batchvlm's own ops, on the job's device) and `reference` (the family's Hugging
Face image processor, the oracle). Every batch is checked against the plan whichever backend ran.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchvlm.checks import CheckFailed, require
from batchvlm.records import DecodedImage, ImagePlan, PackedBatch, PreparedRecord

BACKGROUNDS = {"black": 0.0, "white": 255.0, "gray": 128.0}


def background_image(kind: str, height: int, width: int, device: torch.device, square: int = 16,
                     white: float = 255.0, gray: float = 200.0) -> torch.Tensor:
    """The background that transparent pixels are composited onto (shared/reference/preprocessing.md s3)."""
    if kind in BACKGROUNDS:
        return torch.full((1, height, width), BACKGROUNDS[kind], device=device)
    y = torch.arange(height, device=device)[:, None] // square
    x = torch.arange(width, device=device)[None, :] // square
    gray_cells = (y + x) % 2 == 1  # the top-left cell is gray
    return torch.where(gray_cells, gray, white).to(torch.float32)[None]


def resize_image(image: torch.Tensor, size: tuple[int, int], mode: str) -> torch.Tensor:
    """CHW float in 0..255 -> antialiased resize with PIL's uint8 semantics.

    PIL (and torch's uint8 kernel that the HF processors call) resizes width first, then height, and
    rounds and clamps to uint8 between the two passes. One float pass instead differs by up to 9
    levels at sharp edges; two passes with rounding in between stay within 1 level of PIL.
    """
    height, width = size
    if image.shape[2] != width:
        image = _resize_pass(image, (image.shape[1], width), mode)
    if image.shape[1] != height:
        image = _resize_pass(image, (height, width), mode)
    return image


def _resize_pass(image: torch.Tensor, size: tuple[int, int], mode: str) -> torch.Tensor:
    resized = F.interpolate(image[None], size=size, mode=mode, align_corners=False, antialias=True)[0]
    return resized.round().clamp(0, 255)


def composite(image: torch.Tensor, background: str) -> torch.Tensor:
    """RGBA -> RGB over the background, after resize so alpha is resampled like colour; floor, not round."""
    if image.shape[0] == 3:
        return image
    alpha = (image[3:4] / 255.0).clamp(0, 1)
    bg = background_image(background, image.shape[1], image.shape[2], image.device)
    return (alpha * image[:3] + (1 - alpha) * bg).clamp(0, 255).floor()


class TorchPreprocessor:
    """The family's pixel contract in plain torch ops: resize, composite, pad, normalize, patchify."""

    def __init__(self, family, device: torch.device, background: str):
        self.family = family
        self.device = device
        self.background = background
        self.scale = (1.0 / (255.0 * torch.tensor(family.image_std, dtype=torch.float64))).float().view(3, 1, 1).to(device)
        self.bias = (-torch.tensor(family.image_mean, dtype=torch.float64)
                     / torch.tensor(family.image_std, dtype=torch.float64)).float().view(3, 1, 1).to(device)

    def image_rows(self, image: DecodedImage, plan: ImagePlan) -> tuple[torch.Tensor, tuple]:
        staged = torch.from_numpy(image.pixels).to(self.device).permute(2, 0, 1).float()
        resized = composite(resize_image(staged, plan.resized, self.family.resample), self.background)
        pad_h = plan.padded[0] - resized.shape[1]
        pad_w = plan.padded[1] - resized.shape[2]
        # Pad with raw 0 before normalizing: a normalized 0 would be pixel 127.5.
        padded = F.pad(resized, (0, pad_w, 0, pad_h), value=0.0)
        normalized = padded * self.scale + self.bias
        return self.family.patchify(normalized), self.family.grid_of(normalized)

    def __call__(self, records: list[PreparedRecord]) -> tuple[list[torch.Tensor], list[tuple]]:
        rows, grids = [], []
        for record in records:
            for image, plan in zip(record.images, record.plans):
                image_rows, grid = self.image_rows(image, plan)
                rows.append(image_rows)
                grids.append(grid)
        return rows, grids


class ReferencePreprocessor:
    """The family's Hugging Face image processor, image by image."""

    def __init__(self, family, device: torch.device):
        self.family = family
        self.device = device

    def __call__(self, records: list[PreparedRecord]) -> tuple[list[torch.Tensor], list[tuple]]:
        rows, grids = [], []
        for record in records:
            for image in record.images:
                pixel_values, grid = self.family.reference_preprocess([image.pixels])
                rows.append(pixel_values.to(self.device))
                grids.append(tuple(int(v) for v in grid[0]))
        return rows, grids


def make_preprocessor(backend: str, family, device: torch.device, background: str):
    if backend == "reference":
        return ReferencePreprocessor(family, device)
    return TorchPreprocessor(family, device, background)


def pack(records: list[PreparedRecord], preprocessor) -> PackedBatch:
    """Preprocess every image of the records and pack them, checking grids and row counts per image."""
    rows, grids = preprocessor(records)
    plans = [plan for record in records for plan in record.plans]
    # Which image lost its grid cannot be told from a short list: the driver bisects such a batch.
    require(len(grids) == len(plans), "preprocess.grid_match", "the backend returned a grid count that differs "
            "from the batch's image count", expected=len(plans), observed=len(grids))
    require(len(rows) == len(plans), "preprocess.feature_length", "the backend returned pixels for a different "
            "number of images than the batch has", expected=len(plans), observed=len(rows))
    owners = [(record, index) for record in records for index in range(len(record.plans))]
    for (record, index), plan, grid, image_rows in zip(owners, plans, grids, rows):
        _check_image(record, index, plan, grid, image_rows)
    pixel_values = torch.cat(rows)
    grid_thw = torch.tensor([plan.grid_thw for plan in plans], dtype=torch.int64)
    require(pixel_values.shape[0] == int(grid_thw.prod(-1).sum()), "preprocess.feature_length",
            "packed pixel rows do not match the batch's grids",
            expected=int(grid_thw.prod(-1).sum()), observed=pixel_values.shape[0])
    return PackedBatch(pixel_values=pixel_values, grid_thw=grid_thw, records=records)


def _check_image(record: PreparedRecord, index: int, plan: ImagePlan, grid: tuple, image_rows: torch.Tensor) -> None:
    try:
        require(tuple(grid) == tuple(plan.grid_thw), "preprocess.grid_match",
                f"image {index}: preprocessing produced grid {tuple(grid)}, the plan says {plan.grid_thw}",
                expected=plan.grid_thw, observed=tuple(grid), image_index=index)
        require(image_rows.shape[0] == plan.num_patches, "preprocess.feature_length",
                f"image {index}: {image_rows.shape[0]} pixel rows for {plan.num_patches} planned patches",
                expected=plan.num_patches, observed=image_rows.shape[0], image_index=index)
    except CheckFailed as failure:
        failure.record = record
        raise
