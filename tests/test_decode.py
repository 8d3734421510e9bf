"""Decode basics: upright RGB/RGBA out, limits checked before pixels, bad bytes quarantined with a reason."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from batchvlm.checks import CheckFailed
from batchvlm.config import DecodeConfig
from batchvlm.decode import decode_image


def encoded(image: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def marker_image() -> Image.Image:
    """A 40x20 image whose top-left corner alone is white, so every flip and rotation is visible."""
    pixels = np.zeros((20, 40, 3), dtype=np.uint8)
    pixels[:5, :5] = 255
    return Image.fromarray(pixels)


def failure_of(data: bytes, **limits) -> CheckFailed:
    with pytest.raises(CheckFailed) as caught:
        decode_image(data, DecodeConfig(**limits))
    return caught.value


def test_exif_orientation_is_applied_before_anything_else():
    image = marker_image().transpose(Image.Transpose.ROTATE_90)  # stored rotated ...
    exif = Image.Exif()
    exif[0x0112] = 6  # ... and tagged so that the viewer turns it back (Pillow: ROTATE_270)
    decoded = decode_image(encoded(image, "PNG", exif=exif.tobytes()), DecodeConfig())
    assert decoded.pixels.shape == (20, 40, 3)
    assert decoded.pixels[:5, :5].min() > 200 and decoded.pixels[-5:, -5:].max() < 50


def test_pixel_limit_is_checked_from_the_header():
    failure = failure_of(encoded(marker_image(), "PNG"), max_pixels=799)
    assert failure.check == "decode.too_many_pixels" and failure.observed == "800 pixels"


def test_truncated_jpeg_is_quarantined_not_half_decoded():
    data = encoded(Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)), "JPEG")
    assert failure_of(data[: len(data) // 2]).check == "decode.truncated"


@pytest.mark.parametrize("data", [b"", b"<html>not found</html>", bytes(range(256))])
def test_bytes_that_are_not_an_image_are_unreadable(data):
    assert failure_of(data).check == "decode.unreadable"


def test_formats_outside_the_allowlist_are_refused_by_content():
    failure = failure_of(encoded(marker_image(), "TGA"))
    assert failure.check == "decode.format_not_allowed" and failure.observed == "TGA"


def test_modes_map_to_rgb_or_rgba():
    gray = decode_image(encoded(Image.new("L", (4, 4), 100), "PNG"), DecodeConfig()).pixels
    assert gray.shape == (4, 4, 3) and (gray == 100).all()
    rgba = decode_image(encoded(Image.new("RGBA", (4, 4), (10, 20, 30, 40)), "PNG"), DecodeConfig()).pixels
    assert rgba.shape == (4, 4, 4) and tuple(rgba[0, 0]) == (10, 20, 30, 40)
    deep = Image.fromarray(np.full((4, 4), 40000, dtype=np.uint16))
    sixteen = decode_image(encoded(deep, "PNG"), DecodeConfig()).pixels
    assert sixteen.shape == (4, 4, 3) and (sixteen == round(40000 / 257)).all()  # scaled, not clipped to white
