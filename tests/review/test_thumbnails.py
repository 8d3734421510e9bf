"""Thumbnails of quarantined images, under the run's own decode limits: a picture, or why there is none."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from batchvlm.pipeline.decode import DecodeConfig
from batchvlm.review.thumbnails import Thumbnailer

FAILED_ELSEWHERE = {"image_index": 1, "check": "decode.truncated"}


def png(height: int, width: int) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.full((height, width, 3), 90, np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_a_good_image_is_a_small_picture_with_its_facts():
    thumbnailer = Thumbnailer(DecodeConfig(), size=32)
    try:
        thumbnail = thumbnailer(png(60, 80), None, 0, FAILED_ELSEWHERE)
    finally:
        thumbnailer.close()
    assert thumbnail.data_uri.startswith("data:image/jpeg;base64,")
    assert thumbnail.facts["size"] == "80x60" and thumbnail.facts["format"] == "PNG"


def test_an_image_over_the_runs_limits_or_that_hung_the_job_is_never_decoded():
    thumbnailer = Thumbnailer(DecodeConfig(max_pixels=100))
    try:
        too_big = thumbnailer(png(60, 80), None, 0, FAILED_ELSEWHERE)
        hung = thumbnailer(png(4, 4), None, 1, {"image_index": 1, "check": "decode.timeout"})
    finally:
        thumbnailer.close()
    assert too_big.data_uri is None and "decode.too_many_pixels" in too_big.reason
    assert hung.data_uri is None and "hung the decoder" in hung.reason
