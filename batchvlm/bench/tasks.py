"""Benchmarks measured side by side in one run (their figures and commands: docs/measured.md).

task=scale: bench/scale.py (start-up and memory as the dataset grows).
task=e2e: bench/e2e.py (the job against its tower, the sink against a bare write, stage by stage).
task=host: bench/e2e.py (the e2e bench's host ceiling alone: the job with a zero-cost device stage, bench/host.py).
task=tower: bench/tower.py (the tower alone: images/s and achieved TFLOP/s).
task=jpeg: bench/decoding.py (the batched JPEG decode against the safe path, per kind of JPEG).
task=video: bench/video.py (PyAV's decode of a clip); task=clips: bench/clips.py (clips through the job, its decoder
and the tower).

task=preprocess: one fixed mix of image sizes (real photos, plus synthetic extremes) through the
Triton kernels (where CUDA is), the torch ops and the family's HF processor (with `device=` where
it takes one), each fed the same host uint8 images and timed until its output is on the device.
Throughput is counted in images and in input uint8 bytes per second.

task=claims: bench/metadata.py (metadata operations of claiming, waiting and the duplicate pass as the ranks grow).

task=loader: one epoch of the training loader (read, pack, check) against a bare pyarrow scan of the
same committed shards (every column read, the tokens counted), in tokens per second, and the
packing efficiency of the epoch's plan. The shards are those of `run_dir`, or of a run of the demo
records repeated `copies` times (built on first use).
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from batchvlm.bench import EMBED_JOB
from batchvlm.config import Choice, Config, ConfigError, positive
from batchvlm.demo import build_once, demo_rows, home, photographs
from batchvlm.executor.config import RuntimeConfig
from batchvlm.families import TINY, ModelConfig, load_family
from batchvlm.format.schema import Dtype
from batchvlm.pipeline.preprocess import PreprocessConfig, TorchPreprocessor, TritonPreprocessor
from batchvlm.rundir.layout import RunLayout
from batchvlm.rundir.manifest import listed_shards
from batchvlm.records import DecodedImage, PreparedRecord, SourceRecord, TokenLayout
from batchvlm.training import LoaderConfig, PackedLoader, packing_efficiency


class Task(Choice):
    preprocess = "preprocess"
    scale = "scale"
    loader = "loader"
    e2e = "e2e"
    host = "host"
    tower = "tower"
    jpeg = "jpeg"
    claims = "claims"
    video = "video"
    clips = "clips"
    train = "train"


class Tower(Choice):
    base = "base"
    tiny = "tiny"
    released = "released"


@dataclass
class BenchConfig(Config):
    task: Task = Task.preprocess
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
    run_dir: str | None = None
    """task=loader: the run whose shards are read; default: the demo records times `copies`, embedded once."""
    copies: int = 20
    """task=loader: how many times the demo records are repeated for the default run."""
    max_tokens: int = 4096
    """task=loader: tokens per packed sequence."""
    workers: int = 0
    """task=loader: DataLoader workers of the loader (0: in this process, like the scan)."""
    steps: int = 8
    """task=train: the loader's first `steps` packed batches, each an optimizer step, per timed pass and path."""
    records: int = 16
    """task=e2e|host|tower|jpeg: records (one real photo each, of the common sizes in decoding.REAL_SIZES) run through the
    job and each stage, through the tower, or encoded as each kind of JPEG."""
    tower: Tower = Tower.base
    """task=e2e|tower|train: base (a ViT-B-sized MoonViT, built once) | tiny (the demo tower; task=train: of `model=`)
    | released (task=tower: the family of `model=` at its released size)."""
    dtype: Dtype = Dtype.bfloat16
    """task=e2e|tower: the tower's dtype (model.dtype), as checkpoints ship: bfloat16 | float16 | float32."""
    job_workers: int = 2
    """task=e2e|host: the job's runtime.num_workers; the records are cut into two work units per worker."""
    stages: bool = True
    """task=e2e: also each stage alone, the text side and the sink against a bare write (false: the job's runs, the
    tower, the host ceiling and the decode stage only, as the GPU check runs it)."""
    clip_seconds: float = 10.0
    """task=video|clips: the clip's length (made here from a real photograph, panned; H.264 in MP4)."""
    long_clip_seconds: float = 60.0
    """task=video|clips: the long clip whose peak RSS is measured as its sampled frames decode."""
    long_clip_height: int = 720
    long_clip_width: int = 1280
    """task=clips: the long clip's frame size (task=video's is clip_height x clip_width)."""
    clips: int = 8
    """task=clips: LLaVA records of one clip each run through the job and the tower alone."""
    token_budget: int = PreprocessConfig.token_budget
    """task=clips: the job's preprocess.token_budget (lower: more batches of the same clips, so that the job's rate is
    measured after its first batch)."""
    clip_fps: int = 30
    clip_height: int = 720
    clip_width: int = 1280
    peak_tflops: float = 989.0
    """task=tower: the device's dense bf16 peak that model FLOPs utilization is taken against (the H100/H200 SXM
    datasheet's; an H200 here measured 788 on an 8192-cube matmul)."""
    ranks: int = 1000
    """task=claims: the most simulated ranks; the bench runs 8, 64 and this many (those up to it)."""
    units: int = 100_000
    """task=claims: work units of the simulated run (of one record each)."""
    block_units: int = RuntimeConfig.block_units
    """task=claims: runtime.block_units of the simulated runs."""
    dry_run: bool = False
    """Everything up to the device: the config checked and the task's code imported, nothing run (gpu_check.sh's
    rehearsal on a CPU)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("repeats", "rows", "files", "rss_records", "first_unit_records", "copies", "max_tokens", "steps",
                    "records", "clips", "token_budget", "long_clip_height", "long_clip_width", "job_workers", "peak_tflops", "ranks",
                    "units", "block_units"):
            positive(key, getattr(self, key))
        if self.workers < 0:
            raise ConfigError(f"workers={self.workers} must be >= 0")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigError(f"device={self.device!r} is not one of auto, cpu, cuda, cuda:N")


def bench_device(name: str) -> torch.device:
    """BenchConfig.device: auto is CUDA where there is one."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


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


def best_interleaved(runs: dict, repeats: int) -> dict[str, float]:
    """Best time of each run, the runs taking turns, so that a machine busy for a while slows them alike."""
    times = {name: [] for name in runs}
    for _ in range(repeats + 1):  # the first round warms caches and is not counted
        for name, run in runs.items():
            started = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - started)
    return {name: min(values[1:]) for name, values in times.items()}


def bench_preprocess(config: BenchConfig) -> dict:
    device = bench_device(config.device)
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
    levels = {name: levels_from_hf(family, records, runners[name]()[0], config.background)
              for name in runners if name != "hf"}
    return {"family": family.name, "device": str(device), "images": images, "input_bytes": nbytes,
            "hf_device": str(device) if hf_on_device else "cpu", "repeats": config.repeats,
            "backends": {name: {"seconds": s, "images_per_s": images / s, "bytes_per_s": nbytes / s,
                                "max_levels": levels.get(name, 0.0)} for name, s in seconds.items()},
            "ratios": {f"{a}/{b}": seconds[b] / seconds[a] for a, b in
                       [("triton", "torch"), ("triton", "hf"), ("torch", "hf")] if a in seconds and b in seconds}}


def levels_from_hf(family, records: list[PreparedRecord], rows: list[torch.Tensor], background: str) -> float:
    """The largest difference of a backend's rows from the family's HF processor, in uint8 levels, over the images
    without alpha (the HF processors composite none)."""
    cpu = TorchPreprocessor(family, torch.device("cpu"), background)
    worst = 0.0
    for record, image_rows in zip(records, rows):
        image, plan = record.images[0], record.plans[0]
        if not image.has_alpha:
            levels = cpu.levels(image_rows.float().cpu(), family.reference_preprocess([image.on_host()])[0].float(),
                                plan)
            worst = max(worst, float("inf") if levels is None else levels)
    return worst


def format_preprocess(result: dict) -> str:
    lines = [f"preprocess bench: family {result['family']}, device {result['device']} (HF processor on "
             f"{result['hf_device']}), {result['images']} images, {result['input_bytes'] / 1e6:.1f} MB uint8, "
             f"best of {result['repeats']}; levels: the largest pixel difference from the HF processor (RGB images)",
             f"{'backend':<8} {'images/s':>10} {'MB/s':>10} {'ms/pass':>10} {'levels':>8}"]
    for name, row in result["backends"].items():
        lines.append(f"{name:<8} {row['images_per_s']:>10.1f} {row['bytes_per_s'] / 1e6:>10.1f} "
                     f"{row['seconds'] * 1e3:>10.1f} {row['max_levels']:>8.2f}")
    lines.append("speed-up: " + ", ".join(f"{pair} {ratio:.2f}x" for pair, ratio in result["ratios"].items()))
    return "\n".join(lines)


def _write_repeated_demo(copies: int, folder: Path) -> None:
    import datasets

    features = datasets.Features({"id": datasets.Value("string"), "images": datasets.List(datasets.Image()),
                                  "text": datasets.Value("string")})
    rows = demo_rows()
    for copy in range(copies):
        table = {"id": [f"{r['id']}-{copy}" for r in rows], "text": [r["text"] for r in rows],
                 "images": [[{"bytes": b, "path": None} for b in r["images"]] for r in rows]}
        datasets.Dataset.from_dict(table, features=features).to_parquet(str(folder / f"demo-{copy:03d}.parquet"))


def repeated_demo_run(config: BenchConfig) -> Path:
    """A finished run of the demo records repeated `copies` times, embedded by the job itself on first use."""
    data = build_once(home() / f"bench-loader-x{config.copies}", lambda folder: _write_repeated_demo(config.copies,
                                                                                                       folder))
    root = Path("outputs").resolve()
    checkpoint = config.model.family if config.model.path == TINY else Path(config.model.path).name
    name = f"bench-loader-{checkpoint}-x{config.copies}"
    if not RunLayout(root / name).success.exists():
        model = [f"model.family={config.model.family}", f"model.path={config.model.path}"]
        root.mkdir(parents=True, exist_ok=True)
        result = subprocess.run([*EMBED_JOB, "dataset=parquet", f"dataset.path={data}/*.parquet",
                                 f"output.root={root}", f"run_name={name}", "runtime.progress=false", *model],
                                cwd=root, capture_output=True, text=True)
        if result.returncode:
            raise RuntimeError(f"the embed job for the loader bench failed:\n{result.stderr[-3000:]}")
    return root / name


def bench_loader(config: BenchConfig) -> dict:
    run_dir = Path(config.run_dir) if config.run_dir else repeated_demo_run(config)
    loader = PackedLoader(run_dir, LoaderConfig(max_tokens=config.max_tokens, num_workers=config.workers),
                          rank=0, world_size=1)
    shards = [shard for _, shard in listed_shards(RunLayout(run_dir))]
    tokens = sum(int(lengths.sum()) for lengths in loader.index.lengths)

    def scan() -> None:
        # ParquetFile.read, not pq.read_table: the latter first discovers a dataset at the path, which
        # costs about a third of the read of a 1 MB shard and would flatter the loader.
        counted = sum(pc.sum(pc.list_value_length(pq.ParquetFile(path).read().column("input_ids"))).as_py()
                      for path in shards)
        assert counted == tokens

    def epoch() -> None:
        assert sum(batch.num_tokens for batch in loader) == tokens

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in a DataLoader worker: a batch's small ops gain nothing from intra-op threads
    try:
        seconds = best_interleaved({"pyarrow scan": scan, "loader": epoch}, config.repeats)
    finally:
        torch.set_num_threads(threads)
    packs = loader.epoch_packs()
    return {"run_dir": str(run_dir), "shards": len(shards), "records": sum(map(len, loader.index.lengths)),
            "tokens": tokens, "max_tokens": config.max_tokens, "workers": config.workers, "repeats": config.repeats,
            "readers": {name: {"seconds": s, "tokens_per_s": tokens / s} for name, s in seconds.items()},
            "ratio": seconds["pyarrow scan"] / seconds["loader"], "packs": len(packs),
            "packing_efficiency": packing_efficiency(loader.index, packs, config.max_tokens)}


def format_loader(result: dict) -> str:
    lines = [f"loader bench: {result['run_dir']}, {result['records']} records in {result['shards']} shards, "
             f"{result['tokens']} tokens; max_tokens {result['max_tokens']}, {result['workers']} workers, "
             f"best of {result['repeats']}",
             f"{'reader':<13} {'tokens/s':>12} {'ms/epoch':>10}"]
    for name, row in result["readers"].items():
        lines.append(f"{name:<13} {row['tokens_per_s']:>12.0f} {row['seconds'] * 1e3:>10.1f}")
    lines.append(f"loader / pyarrow scan: {result['ratio']:.2f}x")
    lines.append(f"packing efficiency: {result['packing_efficiency']:.3f} ({result['packs']} packs of {result['max_tokens']})")
    return "\n".join(lines)
