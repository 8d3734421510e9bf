"""The JPEG bench: each kind of JPEG a web dataset holds, decoded both ways."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from batchvlm.bench.decoding import KINDS, bench_jpeg, format_jpeg, jpeg_of, photos


def test_each_kind_is_the_jpeg_it_names():
    pixels = photos(1, [(64, 96)])[0]
    opened = {kind: Image.open(io.BytesIO(jpeg_of(pixels, kind))) for kind in KINDS}
    assert opened["gray"].mode == "L" and opened["baseline 4:2:0"].mode == "RGB"
    assert opened["progressive"].info.get("progressive") and not opened["baseline 4:2:0"].info.get("progressive")
    assert opened["4:4:4"].layer[0][1:3] == (1, 1) and opened["baseline 4:2:0"].layer[0][1:3] == (2, 2)
    assert opened["EXIF-rotated"].getexif()[0x0112] == 6


@pytest.mark.slow  # two photos of each kind through the isolated safe path
def test_on_the_cpu_both_ways_are_libjpeg_turbo_and_give_the_same_pixels():
    from batchvlm.bench.tasks import BenchConfig

    result = bench_jpeg(BenchConfig(task="jpeg", records=2, device="cpu"))
    assert set(result["kinds"]) == set(KINDS)
    for kind, row in result["kinds"].items():
        assert (row["max_levels"], row["share_differing"]) == (0, 0.0), kind
        assert row["safe_images_per_s"] > 0 and row["batched_images_per_s"] > 0
    assert "EXIF-rotated" in format_jpeg(result)
