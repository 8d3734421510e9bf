"""`python jobs/bench.py task=clips`: what clips cost through the job, side by side in one run, on a Qwen2-VL checkpoint
with a ViT-B-sized tower (`tower=base`, qwen2_vl.BASE_VISION, built once) or the tiny demo one (`tower=tiny`), in
`dtype`:
- the decode (PyAV in the job's isolated decoder child, as a worker runs it: header, packets, the frames through the
  last sampled one) in sampled frames/s, against the tower on those frames' rows (frames/s): how many decoders a
  device's tower needs;
- the whole job (`Job.run_all` in this process, `job_workers` workers, after a warm-up job, `preprocess.token_budget`
  = `token_budget`) on LLaVA records of one clip each, in clips/s, against the tower alone on the same packed batches (prepared, batched by the job's budget and
  preprocessed beforehand): the issue's target is 0.8x;
- a long clip (`long_clip_seconds` at `long_clip_height` x `long_clip_width`, 720p by default) decoded by the job's
  decoder child under the byte cap (`video.max_decoded_bytes`): the child's peak RSS (its VmHWM, read from /proc)
  against its RSS before the clip and the sampled frames' RGB bytes.
The clips are photographs panned a few pixels a frame (bench/video.py), each of another photo.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from pathlib import Path

import torch

from batchvlm.bench.decoding import timed
from batchvlm.bench.e2e import budget_groups, run_whole
from batchvlm.bench.tasks import best_seconds
from batchvlm.bench.video import panned_clip, status_mb
from batchvlm.config import ConfigError
from batchvlm.demo import DEMO_VERSION, build_once, home
from batchvlm.executor.config import JobConfig, RuntimeConfig
from batchvlm.executor.job import Parts
from batchvlm.executor.worker import prepare
from batchvlm.families import TINY, ModelConfig, qwen2_vl
from batchvlm.pipeline.decode import DecodeConfig, Decoder
from batchvlm.pipeline.preprocess import PreprocessConfig, preprocess_batch
from batchvlm.pipeline.video import VideoConfig
from batchvlm.records import ImageRef
from batchvlm.rundir.sink import OutputConfig
from batchvlm.sources import make_source
from batchvlm.sources.config import dataset_config

QUESTION = [{"from": "human", "value": "<video>\nWhat does the camera do?"}, {"from": "gpt", "value": "It pans."}]


def clip_checkpoint(config) -> str:
    """The bench's Qwen2-VL checkpoint: the ViT-B-sized one (built once) or the tiny demo one."""
    if config.tower == "released":
        raise ConfigError("tower=released: task=clips builds its own checkpoint (tower=base or tower=tiny)")
    if config.tower == "base":
        return str(build_once(home() / f"demo-{DEMO_VERSION}" / "qwen2_vl_base", qwen2_vl.write_base_checkpoint))
    return TINY


def write_clips(folder: Path, config) -> Path:
    """`config.clips` clips (each of another photo) and their LLaVA records, one clip each, as JSON Lines."""
    lines = []
    for k in range(config.clips):
        name = f"clip-{k:03d}.mp4"
        (folder / name).write_bytes(panned_clip(config.clip_seconds, config.clip_fps, config.clip_height,
                                                config.clip_width, photo=k))
        lines.append(json.dumps({"id": f"clip-{k:03d}", "video": name, "conversations": QUESTION}) + "\n")
    path = folder / "clips.jsonl"
    path.write_text("".join(lines))
    return path


def clips_job(path: Path, out: Path, config, name: str) -> JobConfig:
    """The job on the clip records, cut into two units per worker (a JSON input's units are cut by its bytes)."""
    unit_bytes = math.ceil(path.stat().st_size / (2 * config.job_workers))
    model = ModelConfig(family="qwen2_vl", path=clip_checkpoint(config), device=config.device, dtype=config.dtype)
    return JobConfig(run_name=name, dataset=dataset_config("json", path=str(path), format="llava",
                                                          images_column="image", text_column="conversations",
                                                          image_root=str(path.parent), unit_bytes=unit_bytes),
                     model=model, output=OutputConfig(root=str(out)),
                     preprocess=PreprocessConfig(token_budget=config.token_budget),
                     runtime=RuntimeConfig(progress=False, num_workers=config.job_workers))


def prepared_clips(job: Parts) -> tuple[list, float, int]:
    """The job's records prepared as its workers prepare them (the clips decoded in the isolated child), the seconds
    the decoder took on them, and the frames it decoded (from the first through the last sampled of each)."""
    source = make_source(job.job.dataset, max_bytes=job.job.decode.max_bytes)
    records = [record for unit in source.plan() for record in source.unit_records(unit)]
    decoder = Decoder(job.job.decode, job.job.video)
    sampler = job.family.video_sampler()
    try:
        decoder.clip(records[0].videos[0], 0, sampler)  # the child forked and PyAV loaded before the clock starts
        seconds, _ = timed(lambda: [decoder.clip(record.videos[0], 0, sampler) for record in records], job.device)
        prepared = [prepare(record, job.family, job.job, decoder, job.text) for record in records]
    finally:
        decoder.close()
    return prepared, seconds, sum(max(record.clips[0].indices) + 1 for record in prepared)


def tower_alone(job: Parts, prepared: list, repeats: int) -> tuple[float, list]:
    """Seconds of the tower alone on the records' packed batches (the best of `repeats`), and the batches."""
    batches = [preprocess_batch(group, job.stage.preprocessor) for group in budget_groups(job, prepared)]
    seconds = best_seconds(lambda: [job.stage.encoder(b.pixel_values, b.grid_thw) for b in batches], job.device,
                           repeats)
    return seconds, batches


def long_clip_in_the_decoder(folder: Path, config, sampler) -> dict:
    """A long clip decoded by the job's decoder child (a path under its root, read there), its peak RSS: the child is
    started on a one-second clip first, so that its RSS before is the child's own and its peak the long clip's."""
    short, long = folder / "short.mp4", folder / "long.mp4"
    short.write_bytes(panned_clip(1.0, config.clip_fps, 64, 96))
    long.write_bytes(panned_clip(config.long_clip_seconds, config.clip_fps, config.long_clip_height,
                                 config.long_clip_width))
    limits = VideoConfig()
    decoder = Decoder(DecodeConfig(), limits)
    try:
        decoder.clip(ImageRef(path=str(short), root=str(folder)), 0, sampler)
        before = status_mb("VmRSS", decoder.pid)
        clip = decoder.clip(ImageRef(path=str(long), root=str(folder)), 0, sampler)
        peak = status_mb("VmHWM", decoder.pid)
    finally:
        decoder.close()
    header = clip.header
    return {"long_clip": f"{header.duration_s:g} s, {header.width}x{header.height}, {header.frames} frames, "
                         f"{long.stat().st_size} bytes", "long_sampled": len(clip.decoded.indices),
            "long_bytes": clip.decoded.frames.nbytes, "cap_bytes": limits.max_decoded_bytes,
            "decoder_before_mb": before, "decoder_peak_mb": peak}


def bench_clips(config) -> dict:
    """`config`: bench.BenchConfig (clips, clip_*, long_clip_seconds, tower, dtype, device, job_workers, repeats)."""
    out = Path(tempfile.mkdtemp(prefix="batchvlm-clips-"))
    try:
        path = write_clips(out, config)
        run_whole(clips_job(path, out, config, "clips-warm-up"), out)
        job, job_rate = run_whole(clips_job(path, out, config, "clips"), out)
        prepared, decode_s, decoded = prepared_clips(job)
        tower_s, batches = tower_alone(job, prepared, config.repeats)
        sampled = sum(len(record.clips[0].indices) for record in prepared)
        return {"clips": config.clips, "clip": f"{config.clip_seconds:g} s {config.clip_width}x{config.clip_height} "
                f"at {config.clip_fps} fps", "tower": config.tower, "dtype": config.dtype, "device": str(job.device),
                "workers": config.job_workers, "threads": torch.get_num_threads(), "sampled": sampled,
                "decoded": decoded, "grid": list(prepared[0].clip_plans[0].grid_thw), "batches": len(batches),
                "patches": sum(record.num_patches for record in prepared),
                "decode_frames_per_s": sampled / decode_s, "decode_decoded_per_s": decoded / decode_s,
                "tower_frames_per_s": sampled / tower_s, "tower_clips_per_s": config.clips / tower_s,
                "job_clips_per_s": job_rate, **long_clip_in_the_decoder(out, config, job.family.video_sampler())}
    finally:
        shutil.rmtree(out, ignore_errors=True)


def format_clips(result: dict) -> str:
    decode, tower = result["decode_frames_per_s"], result["tower_frames_per_s"]
    job, alone = result["job_clips_per_s"], result["tower_clips_per_s"]
    return "\n".join([
        f"clips bench: {result['clips']} clips of {result['clip']} (H.264), {result['sampled']} frames sampled "
        f"(grid {result['grid']} each, {result['patches']} patches in {result['batches']} batches), {result['tower']} "
        f"Qwen2-VL tower in {result['dtype']} on {result['device']} ({result['threads']} threads)",
        f"decode (isolated decoder child, one clip at a time): {decode:.3g} sampled frames/s ({result['decoded']} "
        f"frames decoded through the last sampled: {result['decode_decoded_per_s']:.0f} frames/s) vs the tower on "
        f"their rows {tower:.3g} frames/s: {decode / tower:.3g}x (decoders a tower needs: {tower / decode:.3g})",
        f"end-to-end {job:.3g} clips/s ({result['workers']} workers) vs tower alone {alone:.3g} clips/s: "
        f"{job / alone:.2f}x",
        f"long clip {result['long_clip']}: its {result['long_sampled']} sampled frames "
        f"({result['long_bytes'] / 2 ** 20:.0f} MB as RGB, cap {result['cap_bytes'] / 2 ** 20:.0f} MB) decoded by the "
        f"job's decoder child at a peak RSS of {result['decoder_peak_mb']:.0f} MB "
        f"({result['decoder_before_mb']:.0f} MB before the clip)",
    ])
