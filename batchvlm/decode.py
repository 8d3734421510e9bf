"""Safe decoding: bytes in, upright RGB or RGBA uint8 pixels out, or a decode.* failure.

Limits are checked before pixels exist (encoded size, then the header's width x height); the full
image is loaded inside the same guard as the open, so truncation surfaces here and not later.
"""

from __future__ import annotations

import hashlib
import io
import warnings
from pathlib import Path

import numpy as np
from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError

from batchvlm.checks import CheckFailed, require
from batchvlm.config import DecodeConfig
from batchvlm.records import DecodedImage, ImageRef

# A truncated file must fail, never come back half black.
ImageFile.LOAD_TRUNCATED_IMAGES = False


def read_bytes(ref: ImageRef, image_index: int) -> bytes:
    if ref.data is not None:
        return ref.data
    try:
        return Path(ref.path).read_bytes()
    except (OSError, TypeError) as error:
        raise CheckFailed("decode.missing_file", f"cannot read image file {ref.path}: {error}",
                          expected="a readable file", observed=type(error).__name__, image_index=image_index)


def decode_image(data: bytes, cfg: DecodeConfig, image_index: int = 0) -> DecodedImage:
    require(len(data) > 0, "decode.unreadable", "the image is empty (0 bytes)",
            expected="image bytes", observed="0 bytes", image_index=image_index)
    require(len(data) <= cfg.max_bytes, "decode.too_many_pixels",
            f"encoded image is {len(data)} bytes, over decode.max_bytes", expected=f"<= {cfg.max_bytes} bytes",
            observed=f"{len(data)} bytes", image_index=image_index)
    with warnings.catch_warnings():
        # Pillow only warns between 1x and 2x its own bomb limit; here every warning is an error.
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            image = _open_allowed(data, cfg, image_index)
            image_format = image.format
            width, height = image.size
            require(width * height <= cfg.max_pixels, "decode.too_many_pixels",
                    f"image is {width}x{height} = {width * height} pixels, over decode.max_pixels",
                    expected=f"<= {cfg.max_pixels} pixels", observed=f"{width * height} pixels",
                    image_index=image_index)
            image.load()
            image = ImageOps.exif_transpose(image)
            pixels = to_rgb_or_rgba(image)
        except CheckFailed:
            raise
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as error:
            raise CheckFailed("decode.too_many_pixels", str(error), expected="within Pillow's bomb limit",
                              observed=type(error).__name__, image_index=image_index)
        except OSError as error:
            check = "decode.truncated" if "truncated" in str(error) or "broken data stream" in str(error) \
                else "decode.failed"
            raise CheckFailed(check, f"{type(error).__name__}: {error}", expected="a complete image",
                              observed=type(error).__name__, image_index=image_index)
        except (SyntaxError, ValueError, NotImplementedError, OverflowError, MemoryError, IndexError,
                TypeError, KeyError, ZeroDivisionError, EOFError, AttributeError, RuntimeError) as error:
            raise CheckFailed("decode.failed", f"{type(error).__name__}: {error}", expected="a decodable image",
                              observed=type(error).__name__, image_index=image_index)
    return DecodedImage(pixels=pixels, format=image_format, sha256=hashlib.sha256(data).hexdigest())


def _open_allowed(data: bytes, cfg: DecodeConfig, image_index: int) -> Image.Image:
    try:
        return Image.open(io.BytesIO(data), formats=list(cfg.formats))
    except UnidentifiedImageError:
        pass
    try:
        with Image.open(io.BytesIO(data)) as probe:
            actual = probe.format
    except Exception:
        raise CheckFailed("decode.unreadable", "the bytes are not an image Pillow can identify",
                          expected="an image", observed=f"{len(data)} bytes starting {data[:8]!r}",
                          image_index=image_index) from None
    raise CheckFailed("decode.format_not_allowed", f"{actual} images are not in decode.formats",
                      expected=", ".join(cfg.formats), observed=actual, image_index=image_index)


def to_rgb_or_rgba(image: Image.Image) -> np.ndarray:
    """HWC uint8: RGBA where the image carries transparency, RGB otherwise. 16-bit is scaled, not clipped."""
    if image.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        return np.repeat(_scale_to_uint8(np.asarray(image, dtype=np.float64), image.mode)[..., None], 3, axis=2)
    if image.mode == "F":
        return np.repeat(_scale_to_uint8(np.asarray(image, dtype=np.float64), "F")[..., None], 3, axis=2)
    has_alpha = image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in image.info
    converted = image.convert("RGBA" if has_alpha else "RGB")
    return np.asarray(converted, dtype=np.uint8).copy()


def _scale_to_uint8(values: np.ndarray, mode: str) -> np.ndarray:
    if mode.startswith("I;16"):
        return (values / 257.0).round().clip(0, 255).astype(np.uint8)
    low, high = float(values.min()), float(values.max())
    if mode == "I" and low >= 0 and high <= 255:
        return values.astype(np.uint8)
    if mode == "F" and low >= 0 and high <= 1:
        return (values * 255).round().astype(np.uint8)
    span = high - low or 1.0
    return ((values - low) / span * 255).round().clip(0, 255).astype(np.uint8)
