"""Images the family tests share: the demo's real photos, large real photos, and extreme sizes."""

from __future__ import annotations

import numpy as np
import torch
from skimage import data

from batchvlm.pipeline.decode import DecodeConfig
from batchvlm.pipeline.decode import decode_image
from batchvlm.demo import demo_rows


def demo_images() -> list[tuple[str, np.ndarray]]:
    images = []
    for row in demo_rows():
        for index, blob in enumerate(row["images"]):
            try:
                images.append((f"{row['id']}[{index}]", decode_image(blob, DecodeConfig()).pixels))
            except Exception:
                continue  # the demo's deliberately bad images
    return images


def large_photos() -> list[tuple[str, np.ndarray]]:
    """Real photos big enough that every family's resize rule scales them down."""
    retina, hubble, coffee = data.retina(), data.hubble_deep_field(), data.coffee()
    return [("retina_wide", np.concatenate([retina, retina], 1)), ("retina_tall", np.concatenate([retina, retina], 0)),
            ("hubble_tiled", np.tile(hubble, (3, 2, 1))), ("coffee_strip", np.tile(coffee, (1, 14, 1)))]


def photo_of_size(height: int, width: int) -> np.ndarray:
    """A crop (tiled where needed) of a real photo at exactly this size."""
    hubble = data.hubble_deep_field()
    reps = (-(-height // hubble.shape[0]), -(-width // hubble.shape[1]), 1)
    return np.ascontiguousarray(np.tile(hubble, reps)[:height, :width])


def uint8_levels(family, ours: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """|ours - reference| in uint8 levels: normalized values times std * 255, per column of the layout."""
    rows = ours.shape[0]
    std = torch.tensor(family.image_std, dtype=torch.float32)
    p = family.layout.patch_size
    std_patch = family.layout.patchify(std.view(3, 1, 1).expand(3, p * family.layout.merge_size,
                                                                 p * family.layout.merge_size))[:1]
    return (ours - reference).abs() * std_patch * 255 if rows else (ours - reference).abs()


def preprocessed(family, photos: list[np.ndarray]) -> tuple[list[torch.Tensor], list[tuple[int, int, int]]]:
    """Each photo through the torch backend at its planned size: its rows and its grid."""
    from batchvlm.pipeline.preprocess import TorchPreprocessor
    from batchvlm.records import DecodedImage

    preprocessor = TorchPreprocessor(family, torch.device("cpu"), "black")
    rows, grids = [], []
    for pixels in photos:
        image = DecodedImage(pixels[..., :3].copy(), "PNG", "")
        plan = family.plan(image.height, image.width)
        rows.append(preprocessor.image_rows(image, plan)[0])
        grids.append(plan.grid_thw)
    return rows, grids
