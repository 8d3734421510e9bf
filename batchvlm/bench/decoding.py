"""`python jobs/bench.py task=jpeg`: the batched JPEG decode on the job's device (nvJPEG on CUDA, libjpeg-turbo on the
CPU) against the safe path (Pillow's libjpeg-turbo, in its isolated child), on the kinds of JPEG a web dataset holds:
baseline 4:2:0, progressive, gray, 4:4:4 and EXIF-rotated. Per kind: images/s both ways, and how far apart their
pixels are in uint8 levels (largest, mean, share of values that differ). The e2e bench measures its JPEGs the same way.
"""

from __future__ import annotations

import dataclasses
import io
import time

import numpy as np
import torch
from PIL import Image

from batchvlm.bench.tasks import bench_device
from batchvlm.pipeline.decode import DecodeConfig
from batchvlm.demo import photographs
from batchvlm.pipeline.decode import Decoder
from batchvlm.pipeline.jpeg import EXIF_ORIENTATION, JpegBatchDecoder, deferred
from batchvlm.records import ImageRef, PreparedRecord, SourceRecord

KINDS = {
    "baseline 4:2:0": dict(quality=90),
    "progressive": dict(quality=90, progressive=True),
    "gray": dict(quality=90),
    "4:4:4": dict(quality=90, subsampling=0),
    "EXIF-rotated": dict(quality=90),
}
ROTATED = 6  # stored a quarter turn counter-clockwise: the decoder turns it clockwise, swapping height and width
REAL_SIZES = [(480, 640), (600, 800), (768, 1024), (720, 1280), (1080, 1920), (384, 512), (1600, 1200), (900, 900)]
"""(height, width) of the images the benches run on: the common sizes of web images and camera uploads."""


def jpeg_of(pixels: np.ndarray, kind: str) -> bytes:
    """One photo as a JPEG of `kind` (KINDS)."""
    image = Image.fromarray(pixels).convert("L") if kind == "gray" else Image.fromarray(pixels)
    options = dict(KINDS[kind])
    if kind == "EXIF-rotated":
        exif = Image.Exif()
        exif[EXIF_ORIENTATION] = ROTATED
        options["exif"] = exif.tobytes()
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", **options)
    return buffer.getvalue()


def photos(count: int, sizes: list[tuple[int, int]]) -> list[np.ndarray]:
    """`count` real photographs resized to `sizes` (height, width) in turn, each shifted so that none repeats."""
    data = photographs()
    sources = [data.astronaut(), data.coffee(), data.chelsea(), data.rocket(), data.hubble_deep_field(), data.retina()]
    return [np.roll(np.asarray(Image.fromarray(sources[i % len(sources)]).resize(sizes[i % len(sizes)][::-1])), i, 1)
            for i in range(count)]


def timed(run, device: torch.device) -> tuple[float, object]:
    """Seconds `run` takes, with the device's queued work counted (synchronized before and after on CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    result = run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started, result


def decode_both_ways(device: torch.device, decode: DecodeConfig, images: list[bytes], group_sizes: list[int]) -> dict:
    """images/s of the safe path (in the isolated child, one image at a time, as a worker runs it), of the worker's
    header check, and of the batched decode on `device` in groups of `group_sizes` (after one warm-up group: nvJPEG's
    first call sets up its handles); and the pixel differences between the two, in uint8 levels."""
    cfg = dataclasses.replace(decode, jpeg="device")
    safe = Decoder(dataclasses.replace(cfg, jpeg="safe"))
    try:
        safe_s, reference = timed(lambda: [safe(ImageRef(data=image), 0) for image in images], device)
        header_s, jpegs = timed(lambda: [deferred(image, cfg) for image in images], device)
        if None in jpegs:
            raise RuntimeError("the bench's JPEGs must all be deferred to the batched decode")
        records = [PreparedRecord(SourceRecord(f"jpeg-{i:05d}", "u", "bench", i, "", []), [jpeg], [], None)
                   for i, jpeg in enumerate(jpegs)]
        starts = np.cumsum([0] + group_sizes)
        groups = [records[start:stop] for start, stop in zip(starts[:-1], starts[1:])]
        batched = JpegBatchDecoder(device, safe)
        batched(groups[0])

        def decode_all() -> list[PreparedRecord]:
            decoded = [batched(group) for group in groups]
            if any(refused for _, refused in decoded):
                raise RuntimeError("the batched decode refused a bench JPEG")
            return [record for kept, _ in decoded for record in kept]

        batched_s, decoded = timed(decode_all, device)
    finally:
        safe.close()
    differences = [np.abs(ours.images[0].on_host().astype(np.int16) - safe_image.pixels.astype(np.int16))
                   for ours, safe_image in zip(decoded, reference)]
    count = len(images)
    return {"device": str(device), "safe_images_per_s": count / safe_s, "header_images_per_s": count / header_s,
            "batched_images_per_s": count / batched_s, "max_levels": int(max(d.max() for d in differences)),
            "mean_levels": float(np.mean([d.mean() for d in differences])),
            "share_differing": float(np.mean([(d > 0).mean() for d in differences]))}


def bench_jpeg(config) -> dict:
    """`config`: bench.BenchConfig (records: JPEGs per kind, device)."""
    device = bench_device(config.device)
    pixels = photos(config.records, REAL_SIZES)
    groups = [min(16, config.records)] * (config.records // 16) + ([config.records % 16] if config.records % 16 else [])
    return {"device": str(device), "records": config.records,
            "kinds": {kind: decode_both_ways(device, DecodeConfig(), [jpeg_of(p, kind) for p in pixels], groups)
                      for kind in KINDS}}


def format_jpeg(result: dict) -> str:
    lines = [f"JPEG bench: {result['records']} real photos per kind, batched decode on {result['device']} vs the safe "
             "path (Pillow, isolated child)",
             f"{'kind':<16} {'safe im/s':>10} {'batched im/s':>13} {'max levels':>11} {'mean':>8} {'differing':>10}"]
    for kind, row in result["kinds"].items():
        lines.append(f"{kind:<16} {row['safe_images_per_s']:>10.1f} {row['batched_images_per_s']:>13.1f} "
                     f"{row['max_levels']:>11d} {row['mean_levels']:>8.3f} {row['share_differing']:>9.2%}")
    return "\n".join(lines)
