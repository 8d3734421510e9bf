"""Safe decoding: bytes in, upright RGB or RGBA uint8 pixels out, or a decode.* failure.

- Only allowlisted decoders ever run: the bytes are opened with `formats=decode.formats`; a file
  that no allowed decoder takes is named by Pillow's magic-byte `accept` checks alone (no decoder
  of a refused format is invoked, so EPS never reaches Ghostscript).
- Reads are confined and bounded: an image named by path is read only from under its root (links
  followed), only if it is a regular file, and only if its size is within decode.max_bytes, all
  checked before a byte is read; local files are read in the isolated child, under the time limit.
- Limits come before pixels: the encoded size, then the header's width x height; Pillow's bomb
  warning is an error.
- The whole image loads inside the same guard as the open, so truncation surfaces here.
- Animated files (GIF, APNG, WebP, MPO): the first frame only, always; later frames are never read.
- With `decode.isolation=process` each image decodes in a forked child process with a time limit,
  so a segfault or a hang in a C decoder costs that record (decode.crashed / decode.timeout). Its pixels come back
  through shared memory (the arena), not through the pipe: pickled, a 1080p image is 6 MB copied four times.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import functools
import gc
import hashlib
import io
import math
import mmap
import os
import posixpath
import signal
import stat
import struct
import warnings
from multiprocessing.connection import Connection, Pipe

import fsspec
import numpy as np
from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError

from dataclasses import dataclass
from typing import ClassVar

from batchvlm.checks import CheckFailed, require
from batchvlm.config import ByteLimit, Choice, Config, ConfigError, positive, written
from batchvlm.faults import fault
from batchvlm.pipeline.jpeg import EXIF_ORIENTATION, deferred
from batchvlm.pipeline.video import Clip, Sampler, VideoConfig, decode_clip
from batchvlm.records import DecodedImage, EncodedJpeg, ImageRef


class Isolation(Choice):
    process = "process"
    none = "none"


class JpegDecode(Choice):
    safe = "safe"
    device = "device"
    auto = "auto"


@dataclass
class DecodeConfig(Config):
    KEY: ClassVar[str] = "decode"

    formats: list[str] = written(factory=lambda: ["JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF"])
    """Pillow format names allowed, detected from the content, not the file name."""
    max_pixels: int = written(50_000_000)
    """Width x height limit, checked from the header before any pixel is allocated."""
    max_bytes: int = written(64 * 1024 * 1024)
    """Encoded size limit, checked before Pillow sees the bytes."""
    isolation: Isolation = written(Isolation.process)
    """process: decode in a child process, so a decoder crash or hang costs one record (decode.crashed,
    decode.timeout); none: in-process."""
    timeout_s: float = written(30.0)
    """Per-image decode time limit (isolation=process)."""
    jpeg: JpegDecode = written(JpegDecode.safe)
    """safe: every image decodes in the workers on the safe path | device: a JPEG that the batched decoder turns into
    the safe path's pixels has its header checked in the workers and is decoded in the main process, a packed batch's
    JPEGs in one torchvision call on the job's device (nvJPEG on CUDA, libjpeg-turbo on the CPU); every other image,
    and any the batched call fails on, on the safe path | auto: device when the job runs on CUDA, safe otherwise."""

    def __post_init__(self) -> None:
        super().__post_init__()
        positive("decode.timeout_s", self.timeout_s)
        positive("decode.max_pixels", self.max_pixels)
        positive("decode.max_bytes", self.max_bytes)
        if not self.formats:
            raise ConfigError("decode.formats must name at least one format")

    @property
    def byte_limit(self) -> ByteLimit:
        return ByteLimit(self.max_bytes, "decode.too_many_bytes", "decode.max_bytes", "image")


# A truncated file must fail, never come back half black.
ImageFile.LOAD_TRUNCATED_IMAGES = False

# What Pillow's own fuzzers accept as a clean failure, plus the few that malformed files raise in practice.
DECODER_ERRORS = (SyntaxError, ValueError, NotImplementedError, OverflowError, MemoryError, IndexError, TypeError,
                  KeyError, ZeroDivisionError, EOFError, AttributeError, RuntimeError, struct.error)


def is_remote(ref: ImageRef) -> bool:
    return isinstance(ref.path, str) and "://" in ref.path


def read_bytes(ref: ImageRef, cfg: DecodeConfig, image_index: int, limit: ByteLimit | None = None) -> bytes:
    """The image's bytes: given, read from a local path, or through fsspec for a URL the dataset allows; each read
    bounded by `limit` (decode.max_bytes unless a clip's is given), and a path read only from under its root, before
    any byte is read."""
    limit = limit or cfg.byte_limit
    if ref.data is not None:
        _within_bytes(len(ref.data), limit, image_index)
        return ref.data
    if ref.size is not None:  # a tar member the source did not read: its declared size was over the limit
        _within_bytes(ref.size, limit, image_index)
    if not ref.path:
        raise CheckFailed("decode.unreadable", "the record names no image bytes and no path", expected="an image",
                          observed="nothing", image_index=image_index)
    if is_remote(ref) and ref.storage_options is None:
        raise CheckFailed("decode.missing_file", f"the image is given as a URL ({ref.path}); set "
                          "dataset.fetch_urls=true to read it through fsspec", expected="image bytes or a path",
                          observed="a URL", image_index=image_index)
    _within_root(ref, image_index)
    try:
        return _remote_bytes(ref, limit, image_index) if is_remote(ref) else _local_bytes(ref.path, limit, image_index)
    except (OSError, TypeError, ValueError) as error:
        raise CheckFailed("decode.missing_file", f"cannot read image file {ref.path}: {error}",
                          expected="a readable file", observed=type(error).__name__, image_index=image_index)


@functools.lru_cache(maxsize=64)
def _real_root(root: str) -> str:
    """An image root with its links followed, once per root: a source's images share it, and each link followed is a
    metadata operation."""
    return os.path.realpath(root)


def _within_root(ref: ImageRef, image_index: int) -> None:
    """A path under its root, links followed (locally) or `..` resolved (a URL): else it is never opened."""
    if ref.root is None:
        return
    if is_remote(ref):
        inside = posixpath.normpath(ref.path.split("://", 1)[1])
        root = posixpath.normpath(ref.root.split("://", 1)[1])
        within = ref.path.split("://", 1)[0] == ref.root.split("://", 1)[0] and inside.startswith(root + "/")
    else:
        inside, root = os.path.realpath(ref.path), _real_root(ref.root)
        within = os.path.commonpath([inside, root]) == root
    if within:
        return
    if not is_remote(ref) and _named_under(ref.path, ref.root):  # a link (the file's, or a folder's) leads out
        raise CheckFailed("decode.path_outside_root", f"the image path {ref.path} names a file under the image root "
                          f"{ref.root}, but a link takes it to {inside}, outside the image root ({root} with its links "
                          "followed); a link out of the root is not followed, since a record could name one to read "
                          "any file: give dataset.image_root the folder the images really are in, or copy or bind "
                          "them there", expected=f"a file under {root} (the image root, links followed)",
                          observed=f"{ref.path} -> {inside}", image_index=image_index)
    raise CheckFailed("decode.path_outside_root", f"the image path {ref.path} is not under the image root "
                      f"{ref.root}; it is not read", expected=f"a file under {ref.root}", observed=ref.path,
                      image_index=image_index)


def _named_under(path: str, root: str) -> bool:
    """Under the root by name alone: `..` resolved, links not followed."""
    path, root = os.path.abspath(path), os.path.abspath(root)
    return os.path.commonpath([path, root]) == root


def _local_bytes(path: str, limit: ByteLimit, image_index: int) -> bytes:
    info = os.stat(path)
    if not stat.S_ISREG(info.st_mode):
        raise CheckFailed("decode.not_a_file", f"{path} is not a regular file; it is not read",
                          expected="a regular file", observed=stat.filemode(info.st_mode), image_index=image_index)
    _within_bytes(info.st_size, limit, image_index)
    with open(path, "rb") as handle:
        data = handle.read(limit.bytes + 1)  # a file that grew since: still no more than the limit
    _within_bytes(len(data), limit, image_index)
    return data


def _remote_bytes(ref: ImageRef, limit: ByteLimit, image_index: int) -> bytes:
    fs, path = fsspec.core.url_to_fs(ref.path, **ref.storage_options)
    _within_bytes(fs.size(path) or 0, limit, image_index)
    with fs.open(path, "rb") as handle:
        data = handle.read(limit.bytes + 1)
    _within_bytes(len(data), limit, image_index)
    return data


def _within_bytes(size: int, limit: ByteLimit, image_index: int) -> None:
    require(size <= limit.bytes, limit.check, f"the encoded {limit.what} is {size} bytes, over {limit.key}",
            expected=f"<= {limit.bytes} bytes", observed=f"{size} bytes", image_index=image_index)


def sniff_format(data: bytes) -> str | None:
    """The format Pillow's magic-byte checks name, without running any decoder."""
    Image.init()
    prefix = data[:16]
    for name in Image.ID:
        accept = Image.OPEN[name][1]
        try:
            if accept is not None and accept(prefix):
                return name
        except Exception:
            continue
    return None


def decode_image(data: bytes, cfg: DecodeConfig, image_index: int = 0, writable: bool = True) -> DecodedImage:
    """The image's upright RGB or RGBA pixels, or a decode.* failure. Not `writable`, the pixels are a read-only view of
    the one copy Pillow makes of them (the isolated child writes them to shared memory from there)."""
    def fail(check: str, message: str, expected: object, observed: object) -> CheckFailed:
        return CheckFailed(check, message, expected=expected, observed=observed, image_index=image_index)

    if not data:
        raise fail("decode.unreadable", "the image is empty (0 bytes)", "image bytes", "0 bytes")
    _within_bytes(len(data), cfg.byte_limit, image_index)
    with warnings.catch_warnings():
        # Pillow only warns between 1x and 2x its own bomb limit; here every such warning is an error.
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            image = _open_allowed(data, cfg, image_index)
            image_format = image.format
            width, height = image.size
            _within_pixels(width, height, cfg, image_index)
            image.load()  # frame 0: the frame policy is "first frame only"
            ImageOps.exif_transpose(image, in_place=True)  # a copy of every upright image, otherwise
            pixels = to_rgb_or_rgba(image, writable)
        except CheckFailed:
            raise
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as error:
            raise fail("decode.too_many_pixels", str(error), "within Pillow's bomb limit", type(error).__name__)
        except OSError as error:
            truncated = "truncated" in str(error).lower() or "broken data stream" in str(error)
            raise fail("decode.truncated" if truncated else "decode.failed", f"{type(error).__name__}: {error}",
                       "a complete image", type(error).__name__)
        except DECODER_ERRORS as error:
            raise fail("decode.failed", f"{type(error).__name__}: {error}", "a decodable image", type(error).__name__)
    return DecodedImage(pixels=pixels, format=image_format, sha256=hashlib.sha256(data).hexdigest())


def _within_pixels(width: int, height: int, cfg: DecodeConfig, image_index: int) -> None:
    require(width * height <= cfg.max_pixels, "decode.too_many_pixels",
            f"image is {width}x{height} = {width * height} pixels, over decode.max_pixels",
            expected=f"<= {cfg.max_pixels} pixels", observed=f"{width * height} pixels", image_index=image_index)


def upright_size(data: bytes, cfg: DecodeConfig, image_index: int = 0) -> tuple[int, int]:
    """(height, width) of the image as the safe path would give it (EXIF orientation applied), from its header alone,
    under the same format and size limits: what a plan needs, without a pixel decoded."""
    _within_bytes(len(data), cfg.byte_limit, image_index)
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            image = _open_allowed(data, cfg, image_index)
            width, height = image.size
            turned = image.getexif().get(EXIF_ORIENTATION, 1) in (5, 6, 7, 8)
        except CheckFailed:
            raise
        except (OSError, *DECODER_ERRORS, Image.DecompressionBombError, Image.DecompressionBombWarning) as error:
            raise CheckFailed("decode.failed", f"{type(error).__name__}: {error}", expected="a readable header",
                              observed=type(error).__name__, image_index=image_index) from None
    _within_pixels(width, height, cfg, image_index)
    return (width, height) if turned else (height, width)


def decode_or_defer(data: bytes, cfg: DecodeConfig, image_index: int = 0,
                    writable: bool = True) -> DecodedImage | EncodedJpeg:
    """The safe path; with decode.jpeg=device, a JPEG the batched decoder reads alike is only header-checked here
    and left for the main process (jpeg.py)."""
    if cfg.jpeg == "device" and (jpeg := deferred(data, cfg)) is not None:
        return jpeg
    return decode_image(data, cfg, image_index, writable)


def _open_allowed(data: bytes, cfg: DecodeConfig, image_index: int) -> Image.Image:
    try:
        return Image.open(io.BytesIO(data), formats=list(cfg.formats))
    except UnidentifiedImageError:
        sniffed = sniff_format(data)
    if sniffed is None or sniffed in cfg.formats:
        raise CheckFailed("decode.unreadable", "the bytes are not an image Pillow can identify",
                          expected="an image", observed=f"{len(data)} bytes starting {data[:8]!r}",
                          image_index=image_index)
    raise CheckFailed("decode.format_not_allowed", f"{sniffed} images are not in decode.formats",
                      expected=", ".join(cfg.formats), observed=sniffed, image_index=image_index)


def to_rgb_or_rgba(image: Image.Image, writable: bool = True) -> np.ndarray:
    """HWC uint8: RGBA where the image carries transparency, RGB otherwise. Deep images are scaled, not clipped.
    An image already in that mode is not converted (a copy); not `writable`, the array is read-only."""
    if image.mode.startswith("I") or image.mode == "F":
        gray = _scale_to_uint8(np.asarray(image), image.mode)
        return np.repeat(gray[..., None], 3, axis=2)
    has_alpha = image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in image.info
    mode = "RGBA" if has_alpha else "RGB"
    pixels = np.asarray(image if image.mode == mode else image.convert(mode), dtype=np.uint8)
    return pixels.copy() if writable else pixels


def _scale_to_uint8(values: np.ndarray, mode: str) -> np.ndarray:
    """16-bit: /257 (65535 -> 255). 32-bit int that fits 0..255: as is. Other I / F: min-max to 0..255."""
    values = values.astype(np.float64)
    if mode.startswith("I;16"):
        return (values / 257.0).round().clip(0, 255).astype(np.uint8)
    low, high = float(values.min()), float(values.max())
    if mode == "I" and low >= 0 and high <= 255:
        return values.astype(np.uint8)
    if mode == "F" and low >= 0 and high <= 1:
        return (values * 255).round().astype(np.uint8)
    return ((values - low) / ((high - low) or 1.0) * 255).round().clip(0, 255).astype(np.uint8)


# -- isolation ---------------------------------------------------------------------------------
ARENA_LIMIT = 1 << 30
"""Bytes of the shared block a decoder's child writes pixels into, at most (decode.max_pixels RGBA below it); an
image over it (max_pixels raised past 268 M) comes back through the pipe."""


def _serve(conn: Connection, cfg: DecodeConfig, arena: mmap.mmap, ring: mmap.mmap | None) -> None:
    faulthandler.disable()  # a decoder crash is reported by the parent as decode.crashed, not dumped here
    while True:
        try:
            ref, image_index, place, clip = conn.recv()  # clip: (VideoConfig, Sampler) for a clip, None for an image
        except EOFError:
            return
        try:  # a path is read here, under the parent's time limit
            data = read_bytes(ref, cfg, image_index, clip[0].byte_limit if clip else None)
        except CheckFailed as failure:
            conn.send(("failed", failure))
            continue
        digest = hashlib.sha256(data).hexdigest()
        if (target := fault("decode.crash")) and digest.startswith(target):
            os.abort()
        if (target := fault("decode.hang")) and digest.startswith(target):
            signal.pause()
        try:
            if clip:
                _send_clip(conn, decode_clip(data, *clip), arena)
            else:
                conn.send(_written(decode_or_defer(data, cfg, image_index, writable=False), arena, ring, place))
        except CheckFailed as failure:
            conn.send(("failed", failure))


def _send_clip(conn: Connection, clip: Clip, arena: mmap.mmap) -> None:
    """The child's answer for a clip: its header and labels, its frames written to the arena where they fit, else
    sent after the answer as raw bytes through the pipe (pickled, they would be copied whole once more in the child:
    a long clip's frames are up to video.max_decoded_bytes)."""
    frames = clip.decoded.frames
    bare = dataclasses.replace(clip, decoded=dataclasses.replace(clip.decoded, frames=None))
    if frames.nbytes <= len(arena):
        np.frombuffer(arena, np.uint8, frames.nbytes)[:] = frames.reshape(-1)
        conn.send(("shared-clip", (frames.shape, bare)))
        return
    conn.send(("piped-clip", (frames.shape, bare)))
    conn.send_bytes(frames.reshape(-1))


def _written(result: DecodedImage | EncodedJpeg, arena: mmap.mmap, ring: mmap.mmap | None,
             place: tuple[int, int]) -> tuple[str, object]:
    """The child's answer: decoded pixels written where they fit, the free run `place` (offset, bytes) of the
    worker's ring or else the arena, and only their shape and labels sent."""
    if not isinstance(result, DecodedImage):
        return "ok", result
    offset, room = place
    size, labels = result.pixels.nbytes, (result.pixels.shape, result.format, result.sha256)
    if ring is not None and size <= room:
        np.frombuffer(ring, np.uint8, size, offset)[:] = result.pixels.reshape(-1)
        return "ring", labels
    if size <= len(arena):
        np.frombuffer(arena, np.uint8, size)[:] = result.pixels.reshape(-1)
        return "shared", labels
    return "ok", result


class Decoder:
    """Decodes images and clips in a forked child process (restarted after a crash or a hang) or in-process.

    `os.fork` rather than multiprocessing: DataLoader workers are daemonic, and daemonic
    processes may not start multiprocessing children. The arena, a shared anonymous mapping made before the first
    fork, is the child's and this process's both: the child writes an image's pixels (or a clip's sampled frames)
    there, and this process copies them out before it asks for the next one. In a DataLoader worker an image's pixels
    go to the worker's ring instead (`ring`, executor.transport.RingWriter), which the main process maps too: no copy
    anywhere.
    """

    def __init__(self, cfg: DecodeConfig, video: VideoConfig | None = None):
        self.cfg = cfg
        self.video = video or VideoConfig()
        self.pid: int | None = None
        self.conn: Connection | None = None
        self.arena: mmap.mmap | None = None
        self.ring = None  # a worker's RingWriter, set before the first image

    def __call__(self, ref: ImageRef, image_index: int) -> DecodedImage | EncodedJpeg:
        if self.cfg.isolation == "none":
            return decode_or_defer(read_bytes(ref, self.cfg, image_index), self.cfg, image_index)
        if is_remote(ref):  # fsspec's file systems are read here, not in a forked child; the size is checked first
            ref = ImageRef(data=read_bytes(ref, self.cfg, image_index))
        place = self.ring.free_run() if self.ring is not None else (0, 0)
        status, value = self._asked((ref, image_index, place, None), self.cfg.timeout_s, "decode", image_index)
        if status in ("ring", "shared"):
            shape, image_format, digest = value
            pixels = (self.ring.taken(place, shape) if status == "ring"
                      else np.frombuffer(self.arena, np.uint8, math.prod(shape)).reshape(shape).copy())
            return DecodedImage(pixels=pixels, format=image_format, sha256=digest)
        return value

    def clip(self, ref: ImageRef, index: int, sample: Sampler) -> Clip:
        """The clip's header and the frames `sample` picks from it, read and decoded as an image is (in the child
        with decode.isolation=process, under video.timeout_s), or a video.* (decode.* for its path) failure."""
        if self.cfg.isolation == "none":
            return decode_clip(read_bytes(ref, self.cfg, index, self.video.byte_limit), self.video, sample)
        if is_remote(ref):
            ref = ImageRef(data=read_bytes(ref, self.cfg, index, self.video.byte_limit))
        status, (shape, clip) = self._asked((ref, index, (0, 0), (self.video, sample)), self.video.timeout_s, "video",
                                            index)
        if status == "shared-clip":
            frames = np.frombuffer(self.arena, np.uint8, math.prod(shape)).reshape(shape).copy()
        else:
            frames = np.empty(shape, np.uint8)
            self._received(lambda: self.conn.recv_bytes_into(frames.reshape(-1)), "video", index)
        return dataclasses.replace(clip, decoded=dataclasses.replace(clip.decoded, frames=frames))

    def _asked(self, request: tuple, timeout_s: float, stage: str, index: int) -> tuple[str, object]:
        """The child's answer to one request; `stage`.timeout past `timeout_s`, `stage`.crashed where it dies, its
        failure raised."""
        if self.pid is None:
            self._start()
        self.conn.send(request)
        if not self.conn.poll(timeout_s):
            self._stop()
            raise CheckFailed(f"{stage}.timeout", f"decoding took longer than {stage}.timeout_s={timeout_s}",
                              expected=f"<= {timeout_s} s", observed="killed after the limit", image_index=index)
        status, value = self._received(self.conn.recv, stage, index)
        if status == "failed":
            raise value
        return status, value

    def _received(self, receive, stage: str, index: int):
        """What `receive` reads from the child; `stage`.crashed where the child dies before it is all sent."""
        try:
            return receive()
        except (EOFError, OSError):
            code = self._stop()
            raise CheckFailed(f"{stage}.crashed", f"the decoder process died ({_describe(code)})",
                              expected=f"a clean exception or {'an image' if stage == 'decode' else 'a clip'}",
                              observed=_describe(code),
                              image_index=index) from None

    def _start(self) -> None:
        if self.arena is None:
            self.arena = mmap.mmap(-1, min(4 * self.cfg.max_pixels, ARENA_LIMIT))
        parent, child = Pipe()
        # The child must never collect this process's garbage: an object freed there (a PyAV stream left in a
        # reference cycle by an in-process decode) may wait for threads only this process has, and hang forever
        # (FFmpeg's frame threads, joined in avcodec_free_context). Frozen, the objects the child inherits are never
        # collected in it; this process unfreezes and collects as before.
        gc.freeze()
        pid = os.fork()
        if pid == 0:  # the child: serve until the parent closes the pipe
            parent.close()
            try:
                _serve(child, self.cfg, self.arena, None if self.ring is None else self.ring.map)
            finally:
                os._exit(0)
        gc.unfreeze()
        child.close()
        self.pid, self.conn = pid, parent

    def _stop(self) -> int:
        pid, self.pid = self.pid, None
        self.conn.close()
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return os.waitpid(pid, 0)[1]

    def close(self) -> None:
        if self.pid is not None:
            self._stop()

    def __getstate__(self):  # a copy sent to a DataLoader worker starts its own child, with its own arena
        return {"cfg": self.cfg, "video": self.video, "pid": None, "conn": None, "arena": None, "ring": None}


def _describe(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by signal {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit status {os.WEXITSTATUS(status)}" if os.WIFEXITED(status) else f"wait status {status}"
