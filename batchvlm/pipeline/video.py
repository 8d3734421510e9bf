"""Video decoding with PyAV: the header first, then only the sampled frames, in order, under a byte cap.

- **Header before frames.** `probe` reads the container's streams and the video stream's codec, size, frame rate,
  duration and frame count, checks the limits that header alone can (`video.too_long`, `video.decode_bomb` for a
  frame), then demuxes the packets (no decoding) for every frame's presentation timestamp. A clip is sampled and
  its decoded bytes checked against the cap (`planned_bytes`) before a frame is decoded.
- **Time from pts.** A frame's time is its presentation timestamp in the stream's time base, never index / fps,
  so a variable frame rate (detected from the pts steps and flagged, not refused) gives each frame its own time.
- **Sequential decode.** `decode_frames` decodes from the start and keeps the sampled frames, stopping after the
  last one: no seek, so never the wrong frame after an inexact seek to a keyframe. A stream that ends (or whose
  codec fails, or drops a frame) before the last sampled frame is `video.truncated`, with the codec's error kept.
  Only the sampled frames are converted to RGB, each written once into one array held to the cap by its real size.
- **Upright.** A display rotation (read from the first decoded frame: PyAV exposes the display matrix on frames,
  not on the stream nor on the packets) turns each frame, as EXIF orientation turns an image. Sizing a clip without
  decoding its sampled frames (sizing.estimate) still decodes its first frame for it: `display_rotation`.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import ClassVar

import av
import numpy as np

from batchvlm.checks import CheckFailed, require
from batchvlm.config import ByteLimit, Config, ConfigError, positive, written

VFR_TOLERANCE = 0.01
"""Relative spread of the pts steps above which a stream is flagged as variable frame rate; a spread of one tick is
a constant rate's steps rounded to the time base (24 fps in milliseconds: 42, 41, 42)."""


@dataclass
class VideoConfig(Config):
    """What a clip may cost: its bytes before any is read, its header's limits before a frame is decoded, and the
    time its isolated decode may take. The job's `video` group: in the run's fingerprint where the dataset's format
    can name clips (executor.fingerprint)."""

    KEY: ClassVar[str] = "video"

    max_bytes: int = written(2 * 1024 ** 3)
    """Encoded size of a clip (the file, by its size before any byte is read; video.too_many_bytes)."""
    max_duration_s: float = written(3600.0)
    """The stream's duration limit (video.too_long)."""
    max_frames: int = written(216_000)
    """Frames in the stream (an hour at 60 fps; video.too_long)."""
    max_frame_pixels: int = written(50_000_000)
    """Width x height of a frame, as decode.max_pixels for an image (video.decode_bomb)."""
    max_decoded_bytes: int = written(2 * 1024 ** 3)
    """RGB bytes of the sampled frames together (video.decode_bomb)."""
    max_fps: float = written(1000.0)
    """A frame rate above it is a broken header, not a clip (video.fps_invalid)."""
    timeout_s: float = written(300.0)
    """Per-clip time limit of the isolated decode (decode.isolation=process): reading, probing and decoding the
    sampled frames (video.timeout)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("max_bytes", "max_duration_s", "max_frames", "max_frame_pixels", "max_decoded_bytes", "max_fps",
                    "timeout_s"):
            positive(f"video.{key}", getattr(self, key))
        if not isinstance(self.max_frames, int):
            raise ConfigError(f"video.max_frames={self.max_frames!r} must be an integer")

    @property
    def byte_limit(self) -> ByteLimit:
        return ByteLimit(self.max_bytes, "video.too_many_bytes", "video.max_bytes", "clip")


@dataclass(frozen=True)
class VideoHeader:
    """A clip as its container describes it, and its frames' times from the demuxed packets."""

    streams: tuple[str, ...]
    """Every stream of the container, `index:type:codec` (the evidence of video.no_stream)."""
    stream_index: int
    codec: str
    height: int
    width: int
    fps: float
    """The stream's average frame rate from the header."""
    header_frames: int
    """The frame count the container states (0 where it states none: Matroska, WebM)."""
    duration_s: float
    pts: tuple[int, ...]
    """Each frame's presentation timestamp, in presentation order, in units of time_base."""
    time_base: Fraction
    variable_frame_rate: bool

    @property
    def frames(self) -> int:
        return len(self.pts)

    @property
    def timestamps_s(self) -> tuple[float, ...]:
        """Each frame's time from the first frame's, in seconds."""
        return tuple(float((p - self.pts[0]) * self.time_base) for p in self.pts)


@dataclass(frozen=True)
class DecodedVideo:
    frames: np.ndarray
    """(n, H, W, 3) uint8, upright, the sampled frames in the order asked."""
    indices: tuple[int, ...]
    timestamps_s: tuple[float, ...]
    rotation: int
    """Degrees counter-clockwise the frames were turned to stand upright."""


def _open(data: bytes) -> av.container.InputContainer:
    try:
        return av.open(io.BytesIO(data), mode="r")
    except (av.error.FFmpegError, ValueError) as error:
        raise CheckFailed("video.unreadable", f"PyAV cannot open the bytes as a container: {error}",
                          expected="a video container", observed=f"{len(data)} bytes starting {data[:8]!r}") from None


def _describe_streams(container) -> tuple[str, ...]:
    return tuple(f"{s.index}:{s.type}:{s.codec_context.name if s.codec_context else '?'}" for s in container.streams)


def _video_stream(container, streams: tuple[str, ...]):
    """The first video stream that is moving pictures: an attached picture (an MP3's cover art) is not one."""
    for stream in container.streams.video:
        if not stream.disposition & av.stream.Disposition.attached_pic:
            return stream
    raise CheckFailed("video.no_stream", "the container has no video stream", expected="a video stream",
                      observed=", ".join(streams) or "no streams")


def probe(data: bytes, limits: VideoConfig) -> VideoHeader:
    """The clip's header and its frames' times, every limit the header can tell checked, no frame decoded."""
    with _open(data) as container:
        streams = _describe_streams(container)
        stream = _video_stream(container, streams)
        height, width = stream.codec_context.height, stream.codec_context.width
        fps = _frame_rate(stream, limits)
        stated_s = _within_header_limits(stream, container, height, width, limits)
        pts = _presentation_times(container, stream)
        time_base = Fraction(stream.time_base)
        header = VideoHeader(streams=streams, stream_index=stream.index, codec=stream.codec_context.name,
                             height=height, width=width, fps=fps, header_frames=stream.frames,
                             duration_s=_duration(pts, time_base, fps), pts=tuple(pts), time_base=time_base,
                             variable_frame_rate=_variable(pts))
    _within_frame_limits(header, limits)
    _as_long_as_stated(header, stated_s)
    return header


def _frame_rate(stream, limits: VideoConfig) -> float:
    rate = stream.average_rate or stream.guessed_rate
    fps = float(rate) if rate else 0.0
    require(math.isfinite(fps) and 0 < fps <= limits.max_fps, "video.fps_invalid",
            f"the stream's frame rate is {rate}", expected=f"0 < fps <= {limits.max_fps}",
            observed=f"average_rate={stream.average_rate}, guessed_rate={stream.guessed_rate}")
    return fps


def _within_header_limits(stream, container, height: int, width: int, limits: VideoConfig) -> float | None:
    """Before a packet is read: the stated duration and frame count, and one frame's size. Returns the duration the
    header states for the video stream itself, if it states one."""
    stated_s = _stated_duration(stream)
    whole_s = stated_s if stated_s is not None else (container.duration or 0) / av.time_base
    require(whole_s <= limits.max_duration_s, "video.too_long", f"the header states {whole_s:.1f} s",
            expected=f"<= {limits.max_duration_s} s (video.max_duration_s)", observed=f"{whole_s:.1f} s")
    require(stream.frames <= limits.max_frames, "video.too_long", f"the header states {stream.frames} frames",
            expected=f"<= {limits.max_frames} frames (video.max_frames)", observed=f"{stream.frames} frames")
    require(height * width <= limits.max_frame_pixels, "video.decode_bomb",
            f"a frame is {width}x{height} = {width * height} pixels", observed=f"{width * height} pixels",
            expected=f"<= {limits.max_frame_pixels} pixels (video.max_frame_pixels)")
    return stated_s


def _stated_duration(stream) -> float | None:
    """The video stream's own duration: MP4 states it in the stream, Matroska in the track's DURATION tag
    (`00:00:03.100000000`). The container's duration covers its longest stream, so an audio track may outlast it."""
    if stream.duration:
        return float(stream.duration * stream.time_base)
    tag = stream.metadata.get("DURATION", "")
    try:
        hours, minutes, seconds = tag.split(":")
        return int(hours) * 3600 + int(minutes) * 60 + float(seconds)
    except ValueError:
        return None


def _presentation_times(container, stream) -> list[int]:
    """Every frame's pts in presentation order, from the packets alone (demuxed, not decoded); a stream shorter
    than its header's frame count is truncated, the demuxer's error kept."""
    pts, error = [], None
    try:
        for packet in container.demux(stream):
            if packet.size:
                pts.append(packet.pts if packet.pts is not None else packet.dts)
    except av.error.FFmpegError as failure:
        error = failure
    if stream.frames and len(pts) < stream.frames or error is not None and not pts:
        raise CheckFailed("video.truncated", f"the stream holds {len(pts)} of the {stream.frames} frames its header "
                          f"states{f': {error}' if error else ''}", expected=f"{stream.frames} frames",
                          observed=f"{len(pts)} frames{f' ({type(error).__name__}: {error})' if error else ''}")
    require(None not in pts, "video.fps_invalid", "a frame has no timestamp (neither pts nor dts)",
            expected="a pts on every frame", observed=f"{pts.count(None)} frames without one")
    return sorted(pts)


def _as_long_as_stated(header: VideoHeader, stated_s: float | None) -> None:
    """A container that states no frame count (Matroska, WebM) still states a duration: frames missing from its end
    show as a shorter stream (one frame's step of slack for the rounding of the stated figure)."""
    if stated_s is None:
        return
    require(header.duration_s >= stated_s - 1 / header.fps, "video.truncated",
            f"the stream's frames last {header.duration_s:.3f} s, the header states {stated_s:.3f} s",
            expected=f"{stated_s:.3f} s", observed=f"{header.duration_s:.3f} s ({header.frames} frames)")


def _duration(pts: list[int], time_base: Fraction, fps: float) -> float:
    """From the first frame's start to the last frame's end (its step taken as the mean step)."""
    if len(pts) < 2:
        return len(pts) / fps
    span = float((pts[-1] - pts[0]) * time_base)
    return span + span / (len(pts) - 1)


def _variable(pts: list[int]) -> bool:
    steps = np.diff(np.asarray(pts, dtype=np.int64))
    if len(steps) < 2 or steps.min() <= 0:
        return len(steps) >= 2
    return bool(steps.max() - steps.min() > max(1, VFR_TOLERANCE * steps.mean()))


def _within_frame_limits(header: VideoHeader, limits: VideoConfig) -> None:
    require(header.frames > 0, "video.too_few_frames", "the video stream holds no frame",
            expected="at least one frame", observed=f"0 frames (header states {header.header_frames})")
    require(header.frames <= limits.max_frames, "video.too_long", f"the stream holds {header.frames} frames",
            expected=f"<= {limits.max_frames} frames (video.max_frames)", observed=f"{header.frames} frames")
    require(header.duration_s <= limits.max_duration_s, "video.too_long",
            f"the stream's frames last {header.duration_s:.1f} s", observed=f"{header.duration_s:.1f} s",
            expected=f"<= {limits.max_duration_s} s (video.max_duration_s)")


def planned_bytes(header: VideoHeader, frames: int) -> int:
    return frames * header.height * header.width * 3


def check_budget(header: VideoHeader, indices: list[int], limits: VideoConfig) -> None:
    """A sampling plan within the clip and the decoded-bytes cap: before any frame is decoded."""
    require(bool(indices) and all(0 <= i < header.frames for i in indices), "video.too_few_frames",
            "the sampling asks for frames the stream does not hold", expected=f"indices in [0, {header.frames})",
            observed=f"{len(indices)} indices, {min(indices, default=None)}..{max(indices, default=None)}")
    size = planned_bytes(header, len(indices))
    require(size <= limits.max_decoded_bytes, "video.decode_bomb",
            f"{len(indices)} frames of {header.width}x{header.height} decode to {size} bytes", observed=f"{size} bytes",
            expected=f"<= {limits.max_decoded_bytes} bytes (video.max_decoded_bytes)")


def _in_order(frame, position: int, header: VideoHeader) -> None:
    """The decoder gives every frame, in presentation order: a frame dropped on a corrupt packet would shift every
    later frame onto the wrong index."""
    require(frame.pts is None or frame.pts == header.pts[position], "video.truncated",
            f"decoded frame {position} has pts {frame.pts}, the stream's frame {position} has {header.pts[position]}: "
            "the decoder dropped a frame", expected=f"pts {header.pts[position]}", observed=f"pts {frame.pts}")


def decode_frames(data: bytes, header: VideoHeader, indices: list[int], limits: VideoConfig) -> DecodedVideo:
    """The frames at `indices` (presentation order, as in header.timestamps_s), decoded sequentially from the
    start; decoding stops after the last one. Each sampled frame is written once into one array allocated for them
    all, whose bytes never exceed video.max_decoded_bytes (checked from the header, then from the first sampled frame's
    real size); every sampled frame has that size (video.frame_size)."""
    check_budget(header, indices, limits)
    slots: dict[int, list[int]] = {}
    for slot, index in enumerate(indices):
        slots.setdefault(index, []).append(slot)
    last = max(indices)
    frames: np.ndarray | None = None
    decoded, rotation, error = 0, 0, None
    with _open(data) as container:
        stream = next(s for s in container.streams if s.index == header.stream_index)
        stream.thread_type = "AUTO"  # frame and slice threads: the decode is sequential, its work need not be
        try:
            for frame in container.decode(stream):
                if decoded == 0:
                    rotation = _upright_turn(frame)
                _in_order(frame, decoded, header)
                if decoded in slots:
                    pixels = np.rot90(frame.to_ndarray(format="rgb24"), k=rotation // 90)
                    frames = _allocated(pixels, len(indices), header, limits) if frames is None else frames
                    _same_size(pixels, frames, decoded)
                    frames[slots[decoded]] = pixels
                decoded += 1
                if decoded > last:
                    break
        except av.error.FFmpegError as failure:
            error = failure
    if decoded <= last:
        kept_error = f" ({type(error).__name__}: {error})" if error else " (the stream ended)"
        raise CheckFailed("video.truncated", f"decoding stopped after {decoded} of the stream's {header.frames} "
                          f"frames, before sampled frame {last}{kept_error}", expected=f"{header.frames} frames",
                          observed=f"{decoded} frames decoded{kept_error}")
    return DecodedVideo(frames=frames, indices=tuple(indices),
                        timestamps_s=tuple(header.timestamps_s[i] for i in indices), rotation=rotation)


def _upright_turn(frame) -> int:
    """Degrees counter-clockwise (0, 90, 180, 270) that turn a frame upright, from its display matrix."""
    return round(frame.rotation / 90) % 4 * 90


def display_rotation(data: bytes, header: VideoHeader) -> int:
    """The clip's display rotation (degrees counter-clockwise, as DecodedVideo.rotation), at the cost of its first
    frame: PyAV (18) gives the display matrix on decoded frames only, so the decoder runs until it gives one (a
    stream whose first frame does not decode is 0 here: decoding it is the job's check, video.truncated)."""
    with _open(data) as container:
        stream = next(s for s in container.streams if s.index == header.stream_index)
        stream.codec_context.thread_count = 1  # one frame: decoding threads would only add their start-up
        try:
            for frame in container.decode(stream):
                return _upright_turn(frame)
        except av.error.FFmpegError:
            pass
    return 0


def upright_frame_size(header: VideoHeader, rotation: int) -> tuple[int, int]:
    """(height, width) of the clip's frames once turned upright."""
    return (header.width, header.height) if rotation % 180 else (header.height, header.width)


def _allocated(first: np.ndarray, count: int, header: VideoHeader, limits: VideoConfig) -> np.ndarray:
    """The array of the sampled frames, sized by the first one decoded: a stream may differ from its header."""
    size = count * first.nbytes
    require(size <= limits.max_decoded_bytes, "video.decode_bomb",
            f"{count} frames of {first.shape[1]}x{first.shape[0]} (the header said {header.width}x{header.height}) "
            f"decode to {size} bytes", expected=f"<= {limits.max_decoded_bytes} bytes (video.max_decoded_bytes)",
            observed=f"{size} bytes")
    return np.empty((count, *first.shape), dtype=np.uint8)


def _same_size(pixels: np.ndarray, frames: np.ndarray, position: int) -> None:
    require(pixels.shape == frames.shape[1:], "video.frame_size", f"frame {position} is {pixels.shape[1]}x"
            f"{pixels.shape[0]}, the first sampled frame {frames.shape[2]}x{frames.shape[1]}",
            expected=f"{frames.shape[2]}x{frames.shape[1]}", observed=f"{pixels.shape[1]}x{pixels.shape[0]}")


@dataclass(frozen=True)
class Clip:
    """A clip's header and its sampled frames, decoded."""

    header: VideoHeader
    decoded: DecodedVideo


Sampler = Callable[[int, float], list[int]]
"""A family's frame sampling: (frames in the clip, its frame rate) -> the indices to decode. Picklable (a module-level
function, or a functools.partial of one), since an isolated decoder's child receives it."""


def decode_clip(data: bytes, limits: VideoConfig, sample: Sampler) -> Clip:
    """A clip probed, sampled by `sample` from its header, its budget checked (by decode_frames, before any frame is
    decoded), and its sampled frames decoded."""
    header = probe(data, limits)
    return Clip(header, decode_frames(data, header, sample(header.frames, header.fps), limits))
