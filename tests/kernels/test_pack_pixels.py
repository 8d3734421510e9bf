"""The Triton kernels against their plain-torch reference (kernels/reference.py + PatchLayout.patchify).

On CUDA they run compiled; without a GPU, interpreted (TRITON_INTERPRET=1), which Triton reads when
a kernel is defined: so it is set here, before anything imports kernels/pack_pixels.py (only this
file and the triton backend do), and the images stay small. `jobs/gpu_check.sh` runs this file on a GPU.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from batchvlm.kernels.pack_pixels import pack_images  # noqa: E402
from batchvlm.format.layouts import MERGE_WINDOW, RASTER_CHW, RASTER_HWC, PatchLayout  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
P, M = 14, 2
SCALE = torch.tensor([0.0145984, 0.0150077, 0.0142200])  # CLIP's: channels must not be mixed up
BIAS = torch.tensor([-1.7922625, -1.7520971, -1.4802197])

# (source h, w, channels), resized (h, w): down- and upscales, identity axes, thin strips, one pixel.
SIZES = [((37, 53, 3), (20, 30)), ((64, 40, 4), (64, 17)), ((12, 20, 3), (12, 20)), ((9, 50, 4), (30, 14)),
         ((1, 1, 3), (1, 1)), ((60, 7, 3), (5, 3)), ((3, 64, 4), (3, 64))]
LAYOUTS = {RASTER_CHW: PatchLayout(RASTER_CHW, P, M), MERGE_WINDOW: PatchLayout(MERGE_WINDOW, P, M, 2),
           RASTER_HWC: PatchLayout(RASTER_HWC, P)}


def random_images(seed: int) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)
    images = []
    for shape, _ in SIZES:
        pixels = rng.integers(0, 256, shape, dtype=np.uint8)
        if shape[2] == 4:  # fully transparent, fully opaque and partly transparent pixels all occur
            pixels[..., 3] = rng.choice([0, 255, 77, 200], shape[:2])
        images.append(torch.from_numpy(pixels))
    return images


def test_an_empty_batch_packs_to_no_rows():
    packed, rows = pack_images([], [], [], LAYOUTS[RASTER_CHW], "bicubic", "black", SCALE, BIAS, DEVICE)
    assert packed.shape == (0, 3, P, P) and rows == []


# -- the triton backend inside pack(): its checks and the CPU fallback ------------------------
@pytest.mark.parametrize("mode", ["bicubic", "bilinear"])
def test_the_gpu_float_resize_stays_within_two_levels_of_pils_uint8_kernel(mode):
    """GPUs (no uint8 antialiased kernel in torch) resize in two float passes; the CPU in uint8, as PIL.
    Measured: max 2 levels (bicubic upscales), as the families' parity tolerance assumes."""
    from skimage import data

    from batchvlm.kernels.reference import resize_two_passes, resize_uint8

    photo = torch.from_numpy(data.astronaut()).permute(2, 0, 1)
    cases = [(photo, (301, 177)), (photo, (600, 700))]
    cases += [(image.permute(2, 0, 1), size) for image, (_, size) in zip(random_images(3), SIZES)]
    for image, size in cases:
        exact = resize_uint8(image, size, mode)
        floats = resize_two_passes(image.float(), size, mode)
        assert exact.shape == floats.shape
        assert (floats - exact).abs().max() <= 2.0, size
