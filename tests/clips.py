"""Small clips made with PyAV (its wheels bundle FFmpeg's encoders): the videos the tests decode."""

from __future__ import annotations

import io
from fractions import Fraction

import av
import numpy as np


def frame_pixels(index: int, height: int, width: int) -> np.ndarray:
    """A frame whose content tells its index: a gradient that moves with it, the index in the red level of a bar."""
    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([(x * 255 // max(width - 1, 1) + 9 * index) % 256, y * 255 // max(height - 1, 1),
                       np.full_like(x, 128)], axis=-1).astype(np.uint8)
    pixels[: height // 4, : width // 4] = (min(255, 8 * index), 0, 255 - min(255, 8 * index))
    return pixels


def make_clip(frames: int, fps: int = 10, height: int = 64, width: int = 96, codec: str = "libx264",
              container: str = "mp4", audio: bool = False, rotation: int = 0, pts: list[int] | None = None,
              options: dict | None = None) -> bytes:
    """An encoded clip of `frames` frames (`pts`: each frame's time in 1/1000 s, a variable frame rate)."""
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=container, options=options or {}) as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        if pts is not None:
            stream.codec_context.time_base = Fraction(1, 1000)
        if rotation:
            stream.set_display_rotation(rotation)
        sound = out.add_stream("aac", rate=8000) if audio else None
        for index in range(frames):
            frame = av.VideoFrame.from_ndarray(frame_pixels(index, height, width), format="rgb24")
            if pts is not None:
                frame.pts, frame.time_base = pts[index], Fraction(1, 1000)
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
        if sound is not None:
            _mux_silence(out, sound)
    return buffer.getvalue()


def make_audio_only(seconds: float = 0.5) -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as out:
        _mux_silence(out, out.add_stream("aac", rate=8000), seconds)
    return buffer.getvalue()


def make_audio_with_cover_art() -> bytes:
    """Audio with its cover art: a one-frame MJPEG stream marked as an attached picture, as in a music file."""
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as out:
        cover = out.add_stream("mjpeg", rate=1)
        cover.width, cover.height, cover.pix_fmt = 32, 32, "yuvj420p"
        cover.disposition = av.stream.Disposition.attached_pic
        sound = out.add_stream("aac", rate=8000)
        for packet in [*cover.encode(av.VideoFrame.from_ndarray(frame_pixels(0, 32, 32), format="rgb24")),
                       *cover.encode()]:
            out.mux(packet)
        _mux_silence(out, sound)
    return buffer.getvalue()


def _mux_silence(out, stream, seconds: float = 0.5) -> None:
    samples = np.zeros((1, int(8000 * seconds)), dtype=np.float32)
    frame = av.AudioFrame.from_ndarray(samples, format="fltp", layout="mono")
    frame.sample_rate = 8000
    for packet in [*stream.encode(frame), *stream.encode()]:
        out.mux(packet)


def make_size_change(frames: int = 10) -> bytes:
    """An MPEG-TS stream whose frames are 96x64, then 128x96 (two segments joined, as a live stream can switch): the
    header states the first size."""
    first = make_clip(frames, container="mpegts", height=64, width=96, pts=[100 * i for i in range(frames)])
    later = make_clip(frames, container="mpegts", height=96, width=128, pts=[2000 + 100 * i for i in range(frames)])
    return first + later
