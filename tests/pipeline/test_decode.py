"""Decode: upright RGB/RGBA out, limits before pixels, only allowed decoders, crashes and hangs contained."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import io
import pickle

import numpy as np
import pytest
from PIL import Image

from batchvlm.checks import CheckFailed
from batchvlm.pipeline import decode
from batchvlm.pipeline.decode import DecodeConfig, Decoder, decode_image, read_bytes
from batchvlm.records import ImageRef


def encoded(image: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def decoded(data: bytes, **limits) -> np.ndarray:
    return decode_image(data, DecodeConfig(**limits)).pixels


def failure_of(data: bytes, **limits) -> CheckFailed:
    with pytest.raises(CheckFailed) as caught:
        decode_image(data, DecodeConfig(**limits))
    return caught.value


# -- orientation -------------------------------------------------------------------------------
def upright() -> np.ndarray:
    """48 wide x 32 tall, quadrants red / green (top), blue / white (bottom): every flip shows."""
    pixels = np.zeros((32, 48, 3), dtype=np.uint8)
    pixels[:16, :24] = (255, 0, 0)
    pixels[:16, 24:] = (0, 255, 0)
    pixels[16:, :24] = (0, 0, 255)
    pixels[16:, 24:] = (255, 255, 255)
    return pixels


# How a camera stores an upright scene under each EXIF orientation (EXIF 2.3, tag 0x0112).
STORED = {
    1: lambda a: a,
    2: np.fliplr,
    3: lambda a: np.rot90(a, 2),
    4: np.flipud,
    5: lambda a: a.transpose(1, 0, 2),
    6: lambda a: np.rot90(a, 1),
    7: lambda a: np.rot90(a, 2).transpose(1, 0, 2),
    8: lambda a: np.rot90(a, -1),
}


def quadrant_means(pixels: np.ndarray) -> np.ndarray:
    h, w = pixels.shape[0] // 2, pixels.shape[1] // 2
    return np.array([pixels[y:y + h, x:x + w].reshape(-1, 3).mean(0) for y in (0, h) for x in (0, w)])


@pytest.mark.parametrize("orientation", range(1, 9))
def test_every_exif_orientation_comes_out_upright(orientation):
    stored = np.ascontiguousarray(STORED[orientation](upright()))
    exif = Image.Exif()
    exif[0x0112] = orientation
    pixels = decoded(encoded(Image.fromarray(stored), "JPEG", quality=95, exif=exif.tobytes()))
    assert pixels.shape == (32, 48, 3)
    assert np.abs(quadrant_means(pixels) - quadrant_means(upright())).max() < 12


# -- limits and allowlist ----------------------------------------------------------------------
def test_pixel_limit_is_checked_from_the_header():
    failure = failure_of(encoded(Image.new("RGB", (40, 20)), "PNG"), max_pixels=799)
    assert failure.check == "decode.too_many_pixels" and failure.observed == "800 pixels"


def test_pillow_bomb_warning_is_an_error():
    bomb = encoded(Image.new("1", (10_000, 10_000)), "PNG")  # 100 MP: between 1x and 2x Pillow's limit
    assert len(bomb) < 100_000
    failure = failure_of(bomb, max_pixels=10**9)
    assert failure.check == "decode.too_many_pixels" and "DecompressionBomb" in failure.observed


def test_truncated_files_are_quarantined_not_half_decoded():
    noise = Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8))
    for fmt in ("JPEG", "PNG", "WEBP"):
        data = encoded(noise, fmt)
        assert failure_of(data[: len(data) // 2]).check in ("decode.truncated", "decode.failed"), fmt
    assert failure_of(encoded(noise, "JPEG")[:400]).check == "decode.truncated"


@pytest.mark.parametrize("data", [b"", b"<html>not found</html>", bytes(range(256)), b"\x00" * 64])
def test_bytes_that_are_not_an_image_are_unreadable(data):
    assert failure_of(data).check == "decode.unreadable"


@pytest.mark.parametrize("fmt", ["EPS", "PCX", "ICO", "PPM"])
def test_formats_outside_the_allowlist_are_refused_by_their_magic_bytes(fmt):
    failure = failure_of(encoded(Image.new("RGB", (16, 16), (9, 9, 9)), fmt))
    assert failure.check == "decode.format_not_allowed" and failure.observed == fmt


def test_the_allowlist_is_configurable():
    png = encoded(Image.new("RGB", (4, 4)), "PNG")
    assert failure_of(png, formats=["JPEG"]).check == "decode.format_not_allowed"
    assert decoded(encoded(Image.new("RGB", (4, 4)), "PPM"), formats=["PPM"]).shape == (4, 4, 3)


# -- modes -------------------------------------------------------------------------------------
def test_gray_and_one_bit_images_become_rgb():
    assert (decoded(encoded(Image.new("L", (4, 4), 100), "PNG")) == 100).all()
    one_bit = decoded(encoded(Image.new("1", (4, 4), 1), "PNG"))
    assert one_bit.shape == (4, 4, 3) and (one_bit == 255).all()


def test_alpha_survives_for_la_rgba_and_palette_transparency():
    la = decoded(encoded(Image.new("LA", (4, 4), (100, 50)), "PNG"))
    assert la.shape == (4, 4, 4) and tuple(la[0, 0]) == (100, 100, 100, 50)
    rgba = decoded(encoded(Image.new("RGBA", (4, 4), (10, 20, 30, 40)), "PNG"))
    assert tuple(rgba[0, 0]) == (10, 20, 30, 40)
    palette = Image.new("P", (4, 4), 1)
    palette.putpalette([0, 0, 0, 200, 100, 50] + [0] * 762)
    palette.putpixel((0, 0), 0)
    pixels = decoded(encoded(palette, "PNG", transparency=0))
    assert pixels.shape == (4, 4, 4)
    assert pixels[0, 0, 3] == 0 and tuple(pixels[1, 1]) == (200, 100, 50, 255)
    opaque = decoded(encoded(palette, "PNG"))
    assert opaque.shape == (4, 4, 3) and tuple(opaque[1, 1]) == (200, 100, 50)


def test_cmyk_jpeg_is_converted_not_inverted():
    red = decoded(encoded(Image.new("CMYK", (16, 16), (0, 255, 255, 0)), "JPEG", quality=95))
    r, g, b = red.reshape(-1, 3).mean(0)
    assert r > 200 and g < 60 and b < 60


def test_sixteen_bit_is_scaled_not_clipped_to_white():
    deep = decoded(encoded(Image.fromarray(np.array([[0, 20000], [40000, 65535]], dtype=np.uint16)), "PNG"))
    assert deep[..., 0].tolist() == [[0, 78], [156, 255]]


def test_int_and_float_tiffs_are_scaled_to_eight_bits():
    ints = decoded(encoded(Image.fromarray(np.array([[0, 500], [1000, 250]], dtype=np.int32)), "TIFF"))
    assert ints[..., 0].tolist() == [[0, 128], [255, 64]]
    floats = decoded(encoded(Image.fromarray(np.array([[0.0, 0.5], [1.0, 0.25]], dtype=np.float32)), "TIFF"))
    assert floats[..., 0].tolist() == [[0, 128], [255, 64]]


# -- animation ---------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["GIF", "PNG", "WEBP"])
def test_animated_files_give_their_first_frame(fmt):
    frames = [Image.new("RGB", (8, 8), color) for color in ((255, 0, 0), (0, 0, 255), (0, 255, 0))]
    options = {"lossless": True} if fmt == "WEBP" else {}
    data = encoded(frames[0], fmt, save_all=True, append_images=frames[1:], duration=50, loop=0, **options)
    assert getattr(Image.open(io.BytesIO(data)), "n_frames", 1) == 3
    first = decoded(data)
    assert first.shape[:2] == (8, 8) and tuple(first[4, 4, :3]) == (255, 0, 0)
    assert np.array_equal(first, decoded(data))  # the same every time


# -- isolation ---------------------------------------------------------------------------------
def png_bytes(value: int) -> bytes:
    return encoded(Image.new("RGB", (8, 8), (value, value, value)), "PNG")


def test_a_decoder_crash_costs_one_image_and_the_next_decodes(monkeypatch):
    bad, good = png_bytes(1), png_bytes(2)
    monkeypatch.setenv("BATCHVLM_FAULTS", f"decode.crash={hashlib.sha256(bad).hexdigest()[:16]}")
    decoder = Decoder(DecodeConfig())
    try:
        with pytest.raises(CheckFailed) as caught:
            decoder(ImageRef(data=bad), 0)
        assert caught.value.check == "decode.crashed" and "SIGABRT" in caught.value.observed
        assert (decoder(ImageRef(data=good), 1).pixels == 2).all()
    finally:
        decoder.close()


def test_a_decoder_hang_is_cut_off_at_the_time_limit(monkeypatch):
    bad, good = png_bytes(3), png_bytes(4)
    monkeypatch.setenv("BATCHVLM_FAULTS", f"decode.hang={hashlib.sha256(bad).hexdigest()[:16]}")
    decoder = Decoder(DecodeConfig(timeout_s=0.5))
    try:
        with pytest.raises(CheckFailed) as caught:
            decoder(ImageRef(data=bad), 0)
        assert caught.value.check == "decode.timeout"
        assert (decoder(ImageRef(data=good), 1).pixels == 4).all()
    finally:
        decoder.close()


class CountedPipe:
    """A decoder's end of its pipe, counting the pickled size of what the child sends back."""

    def __init__(self, conn):
        self.conn, self.received = conn, []

    def recv(self):
        value = self.conn.recv()
        self.received.append(len(pickle.dumps(value)))
        return value

    def __getattr__(self, name):
        return getattr(self.conn, name)


def test_decoded_pixels_come_back_from_the_child_in_shared_memory_not_through_the_pipe(monkeypatch):
    photo = np.random.default_rng(0).integers(0, 256, (600, 500, 3), dtype=np.uint8)
    data = encoded(Image.fromarray(photo), "PNG")
    decoder = Decoder(DecodeConfig())
    try:
        decoder(ImageRef(data=png_bytes(1)), 0)  # the child started
        decoder.conn = counted = CountedPipe(decoder.conn)
        image = decoder(ImageRef(data=data), 0)
        assert np.array_equal(image.pixels, photo) and image.format == "PNG"
        assert image.sha256 == hashlib.sha256(data).hexdigest() and counted.received[0] < 1000
        monkeypatch.setattr(decode, "ARENA_LIMIT", 1000)  # an image past the arena's size: through the pipe
        decoder.close()
        decoder.arena = None
        assert np.array_equal(decoder(ImageRef(data=data), 0).pixels, photo)
    finally:
        decoder.close()


def test_failures_cross_the_process_boundary_intact():
    decoder = Decoder(DecodeConfig())
    try:
        with pytest.raises(CheckFailed) as caught:
            decoder(ImageRef(data=b"not an image"), 2)
        assert caught.value.check == "decode.unreadable" and caught.value.image_index == 2
    finally:
        decoder.close()


# -- reads: confined to the image root, regular files only, sized before any byte is read -----------------------------
def refused(ref: ImageRef, cfg: DecodeConfig = DecodeConfig(), isolation: str = "process") -> str:
    decoder = Decoder(dataclasses.replace(cfg, isolation=isolation, timeout_s=5))
    try:
        with pytest.raises(CheckFailed) as caught:
            decoder(ref, 0)
    finally:
        decoder.close()
    return caught.value.check


@pytest.mark.parametrize("isolation", ["process", "none"])
def test_a_path_outside_the_image_root_is_never_opened_whether_or_not_it_exists(tmp_path, isolation):
    root = tmp_path / "images"
    root.mkdir()
    (tmp_path / "private.png").write_bytes(png_bytes(7))
    (root / "link.png").symlink_to(tmp_path / "private.png")
    for path in ("/etc/passwd", str(tmp_path / "private.png"), str(root / ".." / "private.png"), str(root / "link.png"),
                 "/no/such/file.png"):
        assert refused(ImageRef(path=path, root=str(root)), isolation=isolation) == "decode.path_outside_root", path


def test_an_image_under_its_root_decodes_and_a_missing_one_is_named(tmp_path):
    (tmp_path / "a.png").write_bytes(png_bytes(7))
    decoder = Decoder(DecodeConfig())
    try:
        assert decoder(ImageRef(path=str(tmp_path / "a.png"), root=str(tmp_path)), 0).height == 8
    finally:
        decoder.close()
    assert refused(ImageRef(path=str(tmp_path / "b.png"), root=str(tmp_path))) == "decode.missing_file"


def test_a_fifo_is_refused_at_once_and_never_hangs_the_job(tmp_path):
    os.mkfifo(tmp_path / "pipe.png")
    assert refused(ImageRef(path=str(tmp_path / "pipe.png"), root=str(tmp_path))) == "decode.not_a_file"


def test_a_huge_sparse_file_is_refused_by_its_size_before_a_byte_is_read(tmp_path):
    sparse = tmp_path / "sparse.png"
    with open(sparse, "wb") as handle:
        handle.truncate(3 * 1024**3)  # 3 GB that take no disk: reading it would take 3 GB of memory
    ref = ImageRef(path=str(sparse), root=str(tmp_path))
    assert refused(ref, isolation="none") == "decode.too_many_bytes"
    assert refused(ImageRef(data=b"x" * 65), DecodeConfig(max_bytes=64)) == "decode.too_many_bytes"


def test_a_symlinked_image_folder_is_refused_with_where_its_link_leads(tmp_path):
    """The path is under the root by its name; its folder is a link out of it: the message says so, and what to do."""
    (tmp_path / "disk").mkdir()
    (tmp_path / "disk" / "0.png").write_bytes(png_bytes(7))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "img").symlink_to(tmp_path / "disk")
    with pytest.raises(CheckFailed) as caught:
        read_bytes(ImageRef(path=str(tmp_path / "data" / "img" / "0.png"), root=str(tmp_path / "data")),
                   DecodeConfig(), 0)
    failed = caught.value
    assert failed.check == "decode.path_outside_root"
    assert f"a link takes it to {tmp_path / 'disk' / '0.png'}, outside the image root" in failed.message
    assert "dataset.image_root" in failed.message and "is not under the image root" not in failed.message
    assert failed.observed == f"{tmp_path / 'data' / 'img' / '0.png'} -> {tmp_path / 'disk' / '0.png'}"
