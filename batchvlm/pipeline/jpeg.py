"""JPEGs decoded in batches by torchvision on the job's device (decode.jpeg=device): nvJPEG on CUDA, libjpeg-turbo
on the CPU.

The decode stage is split for them, because DataLoader workers cannot use CUDA: the worker (in the decoder's child
process under decode.isolation=process) checks the header and routes a JPEG here (`deferred`) only where the batched
decoder gives the safe path's pixels; the main process decodes the JPEGs of a packed batch in one call right
before preprocessing (`JpegBatchDecoder`). Everything else, and every image of a batched call that raises or comes
back in another shape, decodes on the safe path (decode.py), whose checks decide quarantine as they always have.

The reference pixels are the safe path's (Pillow's libjpeg-turbo: islow DCT, fancy upsampling), the decoder the
families' HF processors and the training stacks read images with. On the CPU torchvision runs the same libjpeg-turbo
defaults: identical, 0 levels, over the demo's JPEGs and the Pillow corpus's. nvJPEG upsamples 4:2:0 chroma its own
way: up to 52-55 levels on a fifth of the values of such photos (0 on gray and 4:4:4; measured on an H200), so
`decode.jpeg=device` is a choice the run's fingerprint records (`decoder_of`), and the e2e bench reports how far its
embeddings are from the reference's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import logging
import warnings
from typing import TYPE_CHECKING

import torch
from PIL import Image

from batchvlm.checks import CheckFailed
from batchvlm.devices import is_device_fault
from batchvlm.records import DecodedImage, EncodedJpeg, ImageRef, PreparedRecord, QuarantinedRecord

if TYPE_CHECKING:  # decode imports this module
    from batchvlm.pipeline.decode import DecodeConfig

log = logging.getLogger("batchvlm")

EXIF_ORIENTATION = 0x0112
HUFFMAN_FRAMES = {0xC0, 0xC1, 0xC2}
"""SOF0 baseline, SOF1 extended sequential, SOF2 progressive: the frames both decoders read alike. Lossless,
hierarchical and arithmetic-coded frames go to the safe path."""


# HWC pixels turned as Pillow's exif_transpose turns them, per EXIF orientation.
UPRIGHT = {
    1: lambda x: x,
    2: lambda x: x.flip(1),  # FLIP_LEFT_RIGHT
    3: lambda x: x.flip(0, 1),  # ROTATE_180
    4: lambda x: x.flip(0),  # FLIP_TOP_BOTTOM
    5: lambda x: x.transpose(0, 1),  # TRANSPOSE
    6: lambda x: torch.rot90(x, -1, (0, 1)),  # ROTATE_270: a quarter turn clockwise
    7: lambda x: x.transpose(0, 1).flip(0, 1),  # TRANSVERSE
    8: lambda x: torch.rot90(x, 1, (0, 1)),  # ROTATE_90: a quarter turn counter-clockwise
}


def resolve_jpeg_decode(jpeg: str, device: torch.device) -> str:
    """`auto`: the batched decode where the job runs on CUDA (nvJPEG), the safe path elsewhere."""
    if jpeg == "auto":
        return "device" if device.type == "cuda" else "safe"
    return jpeg


def decoder_of(jpeg: str, device: torch.device) -> str:
    """What decodes a run's JPEGs (decode.jpeg resolved), with its version: the run's fingerprint holds it."""
    if jpeg != "device":
        import PIL

        return f"pillow {PIL.__version__} (libjpeg-turbo), the reference"
    import torchvision

    library = f"nvjpeg (CUDA {torch.version.cuda})" if device.type == "cuda" else "libjpeg-turbo"
    return f"torchvision {torchvision.__version__}, {library}"


def frame_marker(data: bytes) -> int | None:
    """The JPEG's first start-of-frame marker (its coding process), read from the segment headers."""
    position = 2
    while position + 4 <= len(data):
        if data[position] != 0xFF:
            return None
        marker = data[position + 1]
        if marker == 0xFF:  # a fill byte
            position += 1
        elif 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):  # not DHT, JPG, DAC
            return marker
        elif marker == 0xDA:  # a scan before any frame
            return None
        else:
            position += 2 + int.from_bytes(data[position + 2:position + 4], "big")
    return None


def deferred(data: bytes, cfg: DecodeConfig) -> EncodedJpeg | None:
    """The JPEG for the batched decoder, or None where the safe path must decode it (and give any failure).

    Deferred only: within decode.max_bytes and decode.max_pixels; whole to its end-of-image marker (the safe path's
    truncation check cannot run on the device, and libjpeg pads a truncated scan with gray); a Huffman frame of 8-bit
    RGB/YCbCr or grayscale, with no Adobe marker (CMYK, and the Adobe colour transforms); opened by Pillow's JPEG
    decoder alone (not MPO) without a warning."""
    if not (data[:3] == b"\xff\xd8\xff" and data.endswith(b"\xff\xd9") and len(data) <= cfg.max_bytes
            and "JPEG" in cfg.formats and frame_marker(data) in HUFFMAN_FRAMES):
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a bomb warning or corrupt EXIF: the safe path decides
            image = Image.open(io.BytesIO(data), formats=["JPEG"])
            orientation = image.getexif().get(EXIF_ORIENTATION, 1)
    except Exception:  # noqa: BLE001 - whatever the header holds, the safe path reports it
        return None
    if (image.format != "JPEG" or image.mode not in ("RGB", "L") or "adobe" in image.info
            or image.width * image.height > cfg.max_pixels or not isinstance(orientation, int)):
        return None
    orientation = orientation if orientation in UPRIGHT else 1  # exif_transpose leaves other numbers as stored
    height, width = (image.width, image.height) if orientation in (5, 6, 7, 8) else (image.height, image.width)
    return EncodedJpeg(data, height, width, orientation, hashlib.sha256(data).hexdigest())


class JpegBatchDecoder:
    """Decodes the deferred JPEGs of a batch in one torchvision call on `device`; `safe` (a decode.Decoder) takes
    any image the call cannot decode."""

    def __init__(self, device: torch.device, safe):
        self.device, self.safe = device, safe

    def __call__(self, records: list[PreparedRecord]) -> tuple[list[PreparedRecord], list[QuarantinedRecord]]:
        """The records with their JPEGs decoded, and those whose JPEG the safe path refused, quarantined."""
        owners = [(record, index) for record in records for index, image in enumerate(record.images)
                  if isinstance(image, EncodedJpeg)]
        if not owners:
            return records, []
        batched = self._batched([record.images[index] for record, index in owners])
        decoded = dict(zip(((id(record), index) for record, index in owners), batched))
        kept, refused = [], []
        for record in records:
            try:
                images = [self._image(image, decoded.get((id(record), index)), index) if isinstance(image, EncodedJpeg)
                          else image for index, image in enumerate(record.images)]
            except CheckFailed as failure:
                refused.append(QuarantinedRecord(record.source, failure.to_failure()))
                continue
            kept.append(dataclasses.replace(record, images=images))
        return kept, refused

    def _batched(self, jpegs: list[EncodedJpeg]) -> list[torch.Tensor | None]:
        """CHW uint8 RGB per JPEG; None for each JPEG the batched call fails on. A call that raises does not say which
        image it failed on: it is bisected down to those images, which go to the safe path, and the batch's first
        error is logged. A CUDA error is raised: it is the device's, not an image's."""
        data = [torch.frombuffer(bytearray(jpeg.data), dtype=torch.uint8) for jpeg in jpegs]
        errors = []
        decoded = self._bisected(data, errors)
        if errors:
            log.warning("batched JPEG decode on %s: %d of %d images left to the safe path, after %d failed calls; the "
                        "first error: %s: %s", self.device, decoded.count(None), len(jpegs), len(errors),
                        type(errors[0]).__name__, errors[0])
        return decoded

    def _bisected(self, data: list[torch.Tensor], errors: list[Exception]) -> list[torch.Tensor | None]:
        from torchvision.io import ImageReadMode, decode_jpeg

        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="The image decoding and encoding capabilities")  # beta
                return list(decode_jpeg(data, mode=ImageReadMode.RGB, device=self.device))
        except Exception as error:  # noqa: BLE001 - halved until the images it fails on are found
            if is_device_fault(error):
                raise
            errors.append(error)
        if len(data) == 1:
            return [None]
        middle = len(data) // 2
        return self._bisected(data[:middle], errors) + self._bisected(data[middle:], errors)

    def _image(self, jpeg: EncodedJpeg, chw: torch.Tensor | None, index: int) -> DecodedImage:
        if chw is not None:
            pixels = UPRIGHT[jpeg.orientation](chw.permute(1, 2, 0)).contiguous()
            if tuple(pixels.shape) == (jpeg.height, jpeg.width, 3):
                # On the CPU a host array, as the safe path gives; on CUDA the tensor stays on the device.
                return DecodedImage(pixels if pixels.is_cuda else pixels.numpy(), jpeg.format, jpeg.sha256)
        return self.safe(ImageRef(data=jpeg.data), index)

    def close(self) -> None:
        self.safe.close()
