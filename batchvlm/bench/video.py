"""`python jobs/bench.py task=video`: PyAV decoding (pipeline/video.py) on a clip made from a real photograph, panned
so that no two frames are alike, at 720p by default: the header and packets read (no frame decoded), the display
rotation (its first frame decoded: what sizing a clip upright costs beyond its header), every frame
decoded in order, the frames Qwen2-VL's rule samples (2 per second; decoded in order through the last), and those
laid out as the tower's rows on the CPU. Frames/s of each, with the decoded bytes against the cap. Then a long clip's
peak RSS as its sampled frames decode (in a forked child, so that nothing else of the bench counts), and the byte cap
refusing all of its frames before one is decoded.
"""

from __future__ import annotations

import io
import os
import time

import av
import numpy as np
import torch
from PIL import Image

from batchvlm.bench.decoding import photos
from batchvlm.families.qwen2_vl import QwenProcessorParams, QwenVideoParams, qwen_sample_frames, qwen_video_plan
from batchvlm.format.layouts import MERGE_WINDOW, PatchLayout
from batchvlm.pipeline.preprocess import frame_rows
from batchvlm.checks import CheckFailed
from batchvlm.pipeline.video import VideoConfig, check_budget, decode_frames, display_rotation, probe


def panned_clip(seconds: float, fps: int, height: int, width: int, codec: str = "libx264", photo: int = 0) -> bytes:
    """An H.264 MP4 of a photograph (the `photo`-th of decoding.photos) panned a few pixels a frame."""
    photo = np.asarray(Image.fromarray(photos(photo + 1, [(height, width)])[photo]))
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for index in range(round(seconds * fps)):
            frame = av.VideoFrame.from_ndarray(np.roll(photo, 4 * index, axis=1), format="rgb24")
            out.mux(stream.encode(frame))
        out.mux(stream.encode())
    return buffer.getvalue()


def best_of(repeats: int, run) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        result = run()
        times.append(time.perf_counter() - started)
    return min(times), result


def status_mb(field: str, pid: int | str = "self") -> float:
    """A memory figure of a process (this one by default) from /proc (VmRSS now, VmHWM its peak), in MB."""
    with open(f"/proc/{pid}/status") as status:
        kb = next(line.split()[1] for line in status if line.startswith(f"{field}:"))
    return int(kb) / 1024


def peak_rss_mb(run) -> tuple[float, float]:
    """(peak, at start) RSS in MB of a forked child running `run`, as the child measures itself: its start is the
    pages of this process it holds after the fork."""
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(reader)
        try:
            started = status_mb("VmRSS")
            run()
            os.write(writer, f"{status_mb('VmHWM')} {started}".encode())
        finally:
            os._exit(0)
    os.close(writer)
    with os.fdopen(reader) as answer:
        figures = answer.read().split()
    os.waitpid(pid, 0)
    if len(figures) != 2:
        raise RuntimeError("the decoding child died before it reported its memory")
    return float(figures[0]), float(figures[1])


def long_clip(config) -> dict:
    """A long clip's sampled frames decoded under the cap, its peak RSS, and all of its frames refused by the cap."""
    data = panned_clip(config.long_clip_seconds, config.clip_fps, config.clip_height, config.clip_width)
    limits, params, video = VideoConfig(), QwenProcessorParams(), QwenVideoParams()
    header = probe(data, limits)
    indices = qwen_sample_frames(header.frames, header.fps, params, video)
    peak, start = peak_rss_mb(lambda: decode_frames(data, header, indices, limits))
    try:
        check_budget(header, list(range(header.frames)), limits)
        refused = "not refused"
    except CheckFailed as failure:
        refused = f"{failure.check}: {failure.observed}, expected {failure.expected}"
    return {"long_clip": f"{header.duration_s:g} s, {header.frames} frames, {len(data)} bytes",
            "long_sampled": len(indices), "long_bytes": len(indices) * header.height * header.width * 3,
            "peak_mb": peak, "start_mb": start, "all_frames": refused}


def bench_video(config) -> dict:
    long = long_clip(config)  # first: the child's RSS at start is then the bench's imports, not its decoded frames
    height, width = config.clip_height, config.clip_width
    data = panned_clip(config.clip_seconds, config.clip_fps, height, width)
    limits, params, video = VideoConfig(), QwenProcessorParams(), QwenVideoParams()
    layout = PatchLayout(MERGE_WINDOW, params.patch_size, params.merge_size, params.temporal_patch_size)
    probe_s, header = best_of(config.repeats, lambda: probe(data, limits))
    rotation_s, _ = best_of(config.repeats, lambda: display_rotation(data, header))
    every = list(range(header.frames))
    all_s, _ = best_of(config.repeats, lambda: decode_frames(data, header, every, limits))
    indices = qwen_sample_frames(header.frames, header.fps, params, video)
    sampled_s, clip = best_of(config.repeats, lambda: decode_frames(data, header, indices, limits))
    plan = qwen_video_plan(indices, header.frames, header.fps, height, width, params, video)
    frames = torch.from_numpy(clip.frames)
    rows_s, rows = best_of(config.repeats, lambda: frame_rows(frames, plan.resized, layout, params, "bicubic"))
    return {"clip": f"{width}x{height} {header.codec}, {header.frames} frames at {header.fps:g} fps, {len(data)} bytes",
            "probe_s": probe_s, "rotation_s": rotation_s, "frames": header.frames, "all_s": all_s, "sampled": len(indices),
            "sampled_s": sampled_s, "last": max(indices), "seconds": header.duration_s,
            "sampled_bytes": clip.frames.nbytes, "cap_bytes": limits.max_decoded_bytes,
            "rows_s": rows_s, "grid": plan.grid_thw, "rows": tuple(rows.shape), "threads": torch.get_num_threads(),
            **long}


def format_video(result: dict) -> str:
    frames, sampled, last = result["frames"], result["sampled"], result["last"] + 1
    return "\n".join([
        f"clip: {result['clip']}",
        f"header and packets (no frame decoded): {result['probe_s'] * 1e3:.1f} ms; the display rotation (the first "
        f"frame decoded, as the estimate reads it) {result['rotation_s'] * 1e3:.1f} ms more",
        f"every frame decoded and kept as RGB:   {frames / result['all_s']:.0f} frames/s ({result['all_s']:.2f} s)",
        f"Qwen2-VL's {sampled} sampled frames:          {result['sampled_s']:.2f} s: {last} frames decoded in order "
        f"({last / result['sampled_s']:.0f} frames/s), {sampled} kept as RGB ({result['sampled_bytes']} bytes, cap "
        f"{result['cap_bytes']}); {result['seconds'] / result['sampled_s']:.1f}x real time",
        f"their tower rows on the CPU:           {sampled / result['rows_s']:.0f} frames/s ({result['rows_s']:.2f} s, "
        f"grid {list(result['grid'])}, rows {result['rows']}, {result['threads']} threads)",
        f"long clip: {result['long_clip']}: its {result['long_sampled']} sampled frames "
        f"({result['long_bytes'] / 2 ** 20:.0f} MB as RGB) decode at a peak RSS of {result['peak_mb']:.0f} MB "
        f"({result['start_mb']:.0f} MB before decoding); all its frames refused before decoding: {result['all_frames']}",
    ])
