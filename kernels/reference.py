"""The pixel contract in plain torch ops: the `torch` backend, and the oracle of the Triton kernels.

Antialiased resize with PIL's uint8 semantics (Pillow's src/libImaging/Resample.c: github.com/python-pillow/Pillow),
alpha composited onto the background after the resize (floor), bottom/right padding with raw 0, then x*scale + bias.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BACKGROUNDS = {"black": 0.0, "white": 255.0, "gray": 128.0}
CHESSBOARD_SQUARE = 16
CHESSBOARD_WHITE = 255.0
CHESSBOARD_GRAY = 200.0


def background_image(kind: str, height: int, width: int, device: torch.device, square: int = CHESSBOARD_SQUARE,
                     white: float = CHESSBOARD_WHITE, gray: float = CHESSBOARD_GRAY) -> torch.Tensor:
    """The background that transparent pixels are composited onto (preprocess.background; docs/configuration.md)."""
    if kind in BACKGROUNDS:
        return torch.full((1, height, width), BACKGROUNDS[kind], device=device)
    y = torch.arange(height, device=device)[:, None] // square
    x = torch.arange(width, device=device)[None, :] // square
    gray_cells = (y + x) % 2 == 1  # the top-left cell is gray
    return torch.where(gray_cells, gray, white).to(torch.float32)[None]


def resize_image(image: torch.Tensor, size: tuple[int, int], mode: str) -> torch.Tensor:
    """CHW uint8 -> antialiased resize with PIL's uint8 semantics, as float in 0..255.

    On the CPU torch has PIL's own uint8 algorithm (the kernel the HF processors call), exact and about
    twice as fast as float; GPUs have no uint8 antialiased kernel and take the two float passes.
    """
    if image.device.type == "cpu":
        return resize_uint8(image, size, mode)
    return resize_two_passes(image.float(), size, mode)


def resize_uint8(image: torch.Tensor, size: tuple[int, int], mode: str) -> torch.Tensor:
    return F.interpolate(image[None], size=size, mode=mode, align_corners=False, antialias=True)[0].float()


def resize_two_passes(image: torch.Tensor, size: tuple[int, int], mode: str) -> torch.Tensor:
    """PIL resizes width first, then height, rounding and clamping to uint8 between the two passes.

    One float pass instead differs by up to 9 levels at sharp edges; two passes with rounding in
    between stay within 2 levels of PIL (what the Triton kernels compute too).
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


def normalized_image(pixels: torch.Tensor, resized: tuple[int, int], padded: tuple[int, int], resample: str,
                     background: str, scale: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """HWC uint8 (RGB or RGBA) -> the normalized CHW float image at its padded size, ready to patchify.

    `scale` and `bias` are per channel, shaped (3, 1, 1), on the pixels' device.
    """
    image = composite(resize_image(pixels.permute(2, 0, 1), resized, resample), background)
    # Pad with raw 0 before normalizing: a normalized 0 would be pixel 127.5.
    padded_image = F.pad(image, (0, padded[1] - image.shape[2], 0, padded[0] - image.shape[1]), value=0.0)
    return padded_image * scale + bias
