"""decode.jpeg=device: JPEGs header-checked in the worker and decoded in a batch by torchvision, on the CPU here.

Every JPEG either decodes to the safe path's pixels or is left to the safe path, and anything the batched call
cannot decode goes through the safe path, whose checks quarantine it as they always have.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from PIL import Image

from batchvlm.pipeline import jpeg as jpeg_module
from batchvlm.config import ConfigError
from batchvlm.pipeline.decode import DecodeConfig
from batchvlm.pipeline.decode import Decoder, decode_image, decode_or_defer
from batchvlm.demo import demo_rows
from batchvlm.pipeline.jpeg import JpegBatchDecoder, deferred
from batchvlm.records import DecodedImage, EncodedJpeg, PreparedRecord, SourceRecord
from conftest import shared_folder
from test_decode import STORED, encoded, quadrant_means, upright

SAFE = DecodeConfig(isolation="none")
DEVICE = DecodeConfig(isolation="none", jpeg="device")


def record(name: str, *images) -> PreparedRecord:
    return PreparedRecord(SourceRecord(name, "u", "s", 0, "", []), list(images), [], None)


def batch_decoder() -> JpegBatchDecoder:
    return JpegBatchDecoder(torch.device("cpu"), Decoder(dataclasses.replace(DEVICE, jpeg="safe")))


def demo_jpegs() -> dict[str, bytes]:
    return {f"{row['id']}#{i}": data for row in demo_rows() for i, data in enumerate(row["images"])
            if data[:3] == b"\xff\xd8\xff"}


def corpus_jpegs() -> dict[str, bytes]:
    folder = shared_folder("corpus/pillow")
    return {path.name: path.read_bytes() for path in sorted(folder.rglob("*"))
            if path.is_file() and path.read_bytes()[:3] == b"\xff\xd8\xff"}


def assert_decoded_as_the_safe_path(jpegs: dict[str, bytes]) -> int:
    """Each deferred JPEG decodes in one batched call to the safe path's pixels exactly; returns how many deferred."""
    deferrable = {name: jpeg for name, data in jpegs.items() if (jpeg := deferred(data, DEVICE)) is not None}
    kept, refused = batch_decoder()([record(name, jpeg) for name, jpeg in deferrable.items()])
    assert refused == []
    for item in kept:
        safe = decode_image(jpegs[item.source.id], SAFE).pixels
        ours = item.images[0].pixels
        assert ours.shape == safe.shape and np.array_equal(ours, safe), item.source.id
    return len(deferrable)


def test_the_demo_jpegs_decode_in_a_batch_to_the_safe_paths_pixels():
    jpegs = demo_jpegs()
    assert assert_decoded_as_the_safe_path(jpegs) == len(jpegs) - 1  # all but the truncated one


def test_every_pillow_corpus_jpeg_decodes_as_the_safe_path_or_is_left_to_it():
    jpegs = corpus_jpegs()
    assert assert_decoded_as_the_safe_path(jpegs) >= 15  # of 26 here; gray, progressive and EXIF-turned among them
    left = {name for name, data in jpegs.items() if deferred(data, DEVICE) is None}
    assert {"frame_size.mpo", "ultrahdr.jpg", "photoshop-200dpi.jpg"} <= left  # MPO, truncated, Adobe marker


def stored_turned(orientation: int) -> bytes:
    """A JPEG of the upright test image stored turned as `orientation` says, which its EXIF then undoes."""
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encoded(Image.fromarray(np.ascontiguousarray(STORED[orientation](upright()))), "JPEG", quality=95,
                   exif=exif.tobytes())


@pytest.mark.parametrize("orientation", range(1, 9))
def test_every_exif_orientation_is_applied_as_the_safe_path_applies_it(orientation):
    data = stored_turned(orientation)
    jpeg = deferred(data, DEVICE)
    assert (jpeg.height, jpeg.width, jpeg.orientation) == (32, 48, orientation)  # the plan's size is upright
    (item,), _ = batch_decoder()([record("r", jpeg)])
    assert np.array_equal(item.images[0].pixels, decode_image(data, SAFE).pixels)


def test_progressive_gray_and_unsubsampled_jpegs_are_deferred_and_decode_alike():
    photo = Image.fromarray(np.asarray(Image.fromarray(upright()).resize((96, 64), Image.BICUBIC)))
    jpegs = {"progressive": encoded(photo, "JPEG", quality=90, progressive=True),
             "gray": encoded(photo.convert("L"), "JPEG", quality=90),
             "4:4:4": encoded(photo, "JPEG", quality=90, subsampling=0)}
    assert assert_decoded_as_the_safe_path(jpegs) == 3


def test_a_cmyk_jpeg_is_left_to_the_safe_path():
    assert deferred(encoded(Image.new("CMYK", (16, 16), (0, 255, 255, 0)), "JPEG"), DEVICE) is None


def test_a_truncated_jpeg_is_left_to_the_safe_path_which_quarantines_it_as_truncated():
    data = demo_jpegs()["bad_truncated_jpeg#0"]
    assert deferred(data, DEVICE) is None
    with pytest.raises(Exception) as caught:
        decode_or_defer(data, DEVICE)
    assert caught.value.check == "decode.truncated"


def test_limits_still_come_before_pixels():
    data = encoded(Image.new("RGB", (40, 20)), "JPEG")
    assert deferred(data, dataclasses.replace(DEVICE, max_pixels=799)) is None
    assert deferred(data, dataclasses.replace(DEVICE, formats=["PNG"])) is None
    assert isinstance(decode_or_defer(data, DEVICE), EncodedJpeg)
    assert isinstance(decode_or_defer(data, SAFE), DecodedImage)


def test_when_the_batched_call_raises_each_image_goes_through_the_safe_path(monkeypatch):
    """A call that raises does not say which image failed: each is decoded on the safe path, which decodes the
    good one and quarantines the corrupt one under its own check."""
    def failing(*args, **kwargs):
        raise RuntimeError("nvjpeg: bitstream error")

    monkeypatch.setattr("torchvision.io.decode_jpeg", failing)
    jpegs = demo_jpegs()
    good, cut = jpegs["coffee#0"], jpegs["bad_truncated_jpeg#0"]
    as_deferred = dataclasses.replace(deferred(good, DEVICE), data=cut)  # as if the header check had passed it
    kept, refused = batch_decoder()([record("good", deferred(good, DEVICE)), record("cut", as_deferred)])
    assert [item.source.id for item in kept] == ["good"]
    assert np.array_equal(kept[0].images[0].pixels, decode_image(good, SAFE).pixels)
    assert [(q.source.id, q.failure.check, q.failure.image_index) for q in refused] == [("cut", "decode.truncated", 0)]


def test_a_batched_call_failing_on_one_jpeg_is_bisected_to_it_and_its_first_error_logged(monkeypatch, caplog):
    """The rest of the batch still decodes in batched calls; only the JPEG the calls fail on goes to the safe path."""
    from torchvision import io as tv_io

    jpegs = demo_jpegs()
    names = ["coffee#0", "rocket_strip#0", "astronaut#0", "rocket#0"]
    poisoned = jpegs["rocket_strip#0"]
    calls = []
    decode = tv_io.decode_jpeg

    def failing_on_one(data, **kwargs):
        calls.append(len(data))
        if any(bytes(item.numpy()) == poisoned for item in data):
            raise RuntimeError("nvjpeg: bitstream error")
        return decode(data, **kwargs)

    monkeypatch.setattr("torchvision.io.decode_jpeg", failing_on_one)
    safe = []
    decoder = batch_decoder()
    decoder.safe = lambda image, index, inner=decoder.safe: safe.append(image.data) or inner(image, index)
    kept, refused = decoder([record(name, deferred(jpegs[name], DEVICE)) for name in names])
    assert refused == [] and [item.source.id for item in kept] == names
    assert safe == [poisoned] and calls == [4, 2, 1, 1, 2]
    for item in kept:
        assert np.array_equal(item.images[0].pixels, decode_image(jpegs[item.source.id], SAFE).pixels)
    assert [r.getMessage() for r in caplog.records if "batched JPEG" in r.getMessage()] == [
        "batched JPEG decode on cpu: 1 of 4 images left to the safe path, after 3 failed calls; the first error: "
        "RuntimeError: nvjpeg: bitstream error"]


def test_records_without_deferred_jpegs_pass_through_untouched():
    records = [record("png", DecodedImage(np.zeros((2, 2, 3), np.uint8), "PNG", "0" * 64))]
    assert batch_decoder()(records) == (records, [])


def test_decode_jpeg_is_validated_naming_the_key():
    with pytest.raises(ConfigError, match=r"decode\.jpeg='gpu'"):
        DecodeConfig(jpeg="gpu")


def test_auto_decodes_on_the_device_only_where_the_job_runs_on_cuda():
    assert jpeg_module.resolve_jpeg_decode("auto", torch.device("cpu")) == "safe"
    assert jpeg_module.resolve_jpeg_decode("auto", torch.device("cuda", 0)) == "device"
    assert jpeg_module.resolve_jpeg_decode("device", torch.device("cpu")) == "device"


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (bash jobs/gpu_check.sh)")


@needs_cuda
@pytest.mark.parametrize("orientation", range(1, 9))
def test_on_cuda_nvjpeg_decodes_on_the_device_and_turns_the_image_upright(orientation):
    data = stored_turned(orientation)
    decoder = JpegBatchDecoder(torch.device("cuda"), Decoder(dataclasses.replace(DEVICE, jpeg="safe")))
    (item,), _ = decoder([record("r", deferred(data, DEVICE))])
    pixels = item.images[0].pixels
    assert pixels.is_cuda and tuple(pixels.shape) == (32, 48, 3)
    # nvJPEG is not libjpeg-turbo: the quadrants, not the exact values (the e2e bench prints the difference)
    assert np.abs(quadrant_means(pixels.cpu().numpy()) - quadrant_means(upright())).max() < 12
