"""The JPEG bench: each kind of JPEG a web dataset holds, decoded both ways."""

from __future__ import annotations

import io

from PIL import Image

from batchvlm.bench.decoding import KINDS, jpeg_of, photos


def test_each_kind_is_the_jpeg_it_names():
    pixels = photos(1, [(64, 96)])[0]
    opened = {kind: Image.open(io.BytesIO(jpeg_of(pixels, kind))) for kind in KINDS}
    assert opened["gray"].mode == "L" and opened["baseline 4:2:0"].mode == "RGB"
    assert opened["progressive"].info.get("progressive") and not opened["baseline 4:2:0"].info.get("progressive")
    assert opened["4:4:4"].layer[0][1:3] == (1, 1) and opened["baseline 4:2:0"].layer[0][1:3] == (2, 2)
    assert opened["EXIF-rotated"].getexif()[0x0112] == 6
