"""Benchmarks measured side by side in one run (DESIGN.md, Performance model).

task=scale: batchvlm/bench_scale.py (start-up and memory as the dataset grows).

task=preprocess: one fixed mix of image sizes (real photos, plus synthetic extremes) through the
Triton kernels (where CUDA is), the torch ops and the family's HF processor (with `device=` where
it takes one), each fed the same host uint8 images and timed until its output is on the device.
Throughput is counted in images and in input uint8 bytes per second.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from batchvlm.config import ConfigError, ModelConfig, _one_of, _positive
from batchvlm.demo import photographs
from batchvlm.families import load_family
from batchvlm.preprocess import TorchPreprocessor, TritonPreprocessor
from batchvlm.records import DecodedImage, PreparedRecord, SourceRecord, TokenLayout


@dataclass
class BenchConfig:
    task: str = "preprocess"
    model: ModelConfig = field(default_factory=ModelConfig)
    """The family whose plan, layout and HF processor are measured."""
    device: str = "auto"
    """auto (cuda when available) | cpu | cuda | cuda:N."""
    repeats: int = 5
    """Timed passes over the mix per backend, after one warm-up pass; the best is reported."""
    background: str = "black"
    rows: int = 1_000_000
    """task=scale: rows of the synthetic dataset (written once under $BATCHVLM_BENCH_DIR or the temp folder)."""
    files: int = 100
    """task=scale: Parquet files the rows are spread over."""
    rss_records: int = 2000
    """task=scale: N, the records of the smaller of the two full runs whose peak RSS is compared (10N)."""
    first_unit_records: int = 1000
    """task=scale: dataset.unit_records of the run timed to its first committed unit."""

    def __post_init__(self) -> None:
        _one_of("task", self.task, ("preprocess", "scale"))
        _positive("repeats", self.repeats)
        for key in ("rows", "files", "rss_records", "first_unit_records"):
            _positive(key, getattr(self, key))
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigError(f"device={self.device!r} is not one of auto, cpu, cuda, cuda:N")


def image_mix() -> list[tuple[str, np.ndarray]]:
    """Photos of common sizes, one RGBA logo, and the extremes: large enough to be scaled down, thin, tiny."""
    data = photographs()
    coffee, rocket = data.coffee(), data.rocket()
    return [("astronaut", data.astronaut()), ("coffee", coffee), ("chelsea", data.chelsea()), ("rocket", rocket),
            ("hubble", data.hubble_deep_field()), ("retina", data.retina()), ("logo_rgba", data.logo()),
            ("coffee_6mp", np.ascontiguousarray(np.tile(coffee, (5, 5, 1)))),
            ("rocket_strip", np.ascontiguousarray(np.tile(rocket[200:216], (1, 4, 1)))),
            ("coffee_column", np.ascontiguousarray(coffee[:, 280:300])),
            ("tiny", np.ascontiguousarray(coffee[200:220, 300:320]))]


def records_of(mix: list[tuple[str, np.ndarray]], family) -> list[PreparedRecord]:
    records = []
    for name, pixels in mix:
        image = DecodedImage(pixels, "PNG", "")
        source = SourceRecord(id=name, unit_id="bench", source="bench", row=0, text="", images=[])
        records.append(PreparedRecord(source, [image], [family.plan(image.height, image.width)],
                                      TokenLayout([], [], [])))
    return records


def hf_runner(family, mix, device: torch.device):
    """The family's HF processor on the whole mix in one call, as a user would call it."""
    processor = family.reference_processor()
    kwargs = {"return_tensors": "pt"}
    if "device" in getattr(processor, "valid_kwargs", object).__annotations__:
        kwargs["device"] = str(device)
    # HF processors take RGB; they have no transparent-background compositing.
    tensors = [torch.from_numpy(np.ascontiguousarray(pixels[..., :3])).permute(2, 0, 1) for _, pixels in mix]
    return lambda: processor(images=tensors, **kwargs)["pixel_values"], "device" in kwargs


def best_seconds(run, device: torch.device, repeats: int) -> float:
    run()  # warm-up: kernel compilation, allocator, caches
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
    return min(times)


def bench_preprocess(config: BenchConfig) -> dict:
    device = torch.device("cuda" if config.device == "auto" and torch.cuda.is_available() else
                          "cpu" if config.device == "auto" else config.device)
    family = load_family(config.model)
    mix = image_mix()
    records = records_of(mix, family)
    runners = {}
    if device.type == "cuda":
        runners["triton"] = lambda backend=TritonPreprocessor(family, device, config.background): backend(records)
    runners["torch"] = lambda backend=TorchPreprocessor(family, device, config.background): backend(records)
    hf, hf_on_device = hf_runner(family, mix, device)
    runners["hf"] = hf
    seconds = {name: best_seconds(run, device, config.repeats) for name, run in runners.items()}
    images, nbytes = len(mix), sum(pixels.nbytes for _, pixels in mix)
    return {"family": family.name, "device": str(device), "images": images, "input_bytes": nbytes,
            "hf_device": str(device) if hf_on_device else "cpu", "repeats": config.repeats,
            "backends": {name: {"seconds": s, "images_per_s": images / s, "bytes_per_s": nbytes / s}
                         for name, s in seconds.items()},
            "ratios": {f"{a}/{b}": seconds[b] / seconds[a] for a, b in
                       [("triton", "torch"), ("triton", "hf"), ("torch", "hf")] if a in seconds and b in seconds}}


def format_preprocess(result: dict) -> str:
    lines = [f"preprocess bench: family {result['family']}, device {result['device']} (HF processor on "
             f"{result['hf_device']}), {result['images']} images, {result['input_bytes'] / 1e6:.1f} MB uint8, "
             f"best of {result['repeats']}",
             f"{'backend':<8} {'images/s':>10} {'MB/s':>10} {'ms/pass':>10}"]
    for name, row in result["backends"].items():
        lines.append(f"{name:<8} {row['images_per_s']:>10.1f} {row['bytes_per_s'] / 1e6:>10.1f} "
                     f"{row['seconds'] * 1e3:>10.1f}")
    lines.append("speed-up: " + ", ".join(f"{pair} {ratio:.2f}x" for pair, ratio in result["ratios"].items()))
    return "\n".join(lines)
