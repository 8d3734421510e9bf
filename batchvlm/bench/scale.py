"""`python jobs/bench.py task=scale`: start-up and memory as the dataset grows, measured in one run.

A synthetic dataset (`rows` over `files` Parquet files of small images) is written once; then:
- the plan of all of it and of a tenth of it (same files, fewer rows each): seconds and bytes read;
- the embed job started on all of it: seconds to its first committed unit (then stopped);
- the job run to the end on N and on 10N records: peak RSS of its largest process, side by side;
- the `datasets` cache before and after (the job must not copy the inputs into it).
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from batchvlm.bench import EMBED_JOB
from batchvlm.sources.config import dataset_config
from batchvlm.rundir.layout import RunLayout
from batchvlm.rundir.manifest import committed_units
from batchvlm.sources import make_source


def small_images(count: int = 16) -> list[bytes]:
    rng = np.random.default_rng(0)
    images = []
    for index in range(count):
        side = 28 + 4 * (index % 4)
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (side, side + 8, 3), dtype=np.uint8)).save(buffer, format="JPEG")
        images.append(buffer.getvalue())
    return images


def write_dataset(folder: Path, rows: int, files: int) -> Path:
    """`rows` records over `files` Parquet files (row groups of 1,000), written once per size."""
    target = folder / f"rows{rows}-files{files}"
    if target.exists():
        return target
    tmp = folder / f".{target.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    images, per_file = small_images(), rows // files
    for index in range(files):
        ids = [f"f{index:04d}-{row:07d}" for row in range(per_file)]
        table = pa.table({"id": ids, "images": [[images[row % len(images)]] for row in range(per_file)],
                          "text": ["<image> a small synthetic image"] * per_file})
        # uncompressed: a repeated image stored in full each time, as distinct images would be
        pq.write_table(table, tmp / f"part-{index:05d}.parquet", row_group_size=1000, compression="none",
                       use_dictionary=False)
    tmp.rename(target)
    return target


def read_bytes_so_far() -> int:
    return int(dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())["rchar"])


def plan_cost(path: Path, limit: int | None) -> dict:
    started, before = time.perf_counter(), read_bytes_so_far()
    units = make_source(dataset_config("parquet", path=str(path), limit=limit)).plan()
    return {"seconds": time.perf_counter() - started, "bytes_read": read_bytes_so_far() - before,
            "units": len(units), "records": sum(unit.num_rows for unit in units)}


def _job(path: Path, out: Path, run_name: str, env: dict, *overrides: str) -> subprocess.Popen:
    """The job in a session of its own, so that stopping it stops its DataLoader workers and decoder too."""
    return subprocess.Popen([*EMBED_JOB, "dataset=parquet", f"dataset.path={path}", f"output.root={out}",
                             f"run_name={run_name}", "runtime.progress=false", *overrides], cwd=out,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)


def first_commit_seconds(path: Path, out: Path, env: dict, unit_records: int) -> float:
    started = time.perf_counter()
    job = _job(path, out, "first", env, f"dataset.unit_records={unit_records}")
    layout = RunLayout(out / "first")
    try:
        while not committed_units(layout):
            if job.poll() is not None:
                raise RuntimeError(f"the embed job exited with {job.returncode} before committing a unit")
            time.sleep(0.05)
        return time.perf_counter() - started
    finally:
        with contextlib.suppress(ProcessLookupError):  # the job and every process it started
            os.killpg(job.pid, signal.SIGKILL)
        job.wait()


def peak_rss_mb(path: Path, out: Path, env: dict, per_file: int, run_name: str) -> float:
    """Peak RSS of the job's largest process (wait4 reports the child and its reaped descendants)."""
    job = _job(path, out, run_name, env, f"dataset.limit={per_file}", "dataset.unit_records=500")
    _, status, usage = os.wait4(job.pid, 0)
    job.returncode = os.waitstatus_to_exitcode(status)
    if job.returncode != 0:
        raise RuntimeError(f"the embed job ({run_name}) exited with {job.returncode}")
    return usage.ru_maxrss / 1024


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) if folder.exists() else 0


def bench_scale(config) -> dict:
    """`config`: bench.BenchConfig (rows, files, rss_records, first_unit_records)."""
    rows, files, rss_records, first_unit_records = config.rows, config.files, config.rss_records, config.first_unit_records
    cache = Path(os.environ.get("BATCHVLM_BENCH_DIR", Path(tempfile.gettempdir()) / "batchvlm-bench"))
    path = write_dataset(cache, rows, files)
    out = Path(tempfile.mkdtemp(prefix="batchvlm-scale-"))
    hf_home = out / "hf-home"
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_DATASETS_CACHE": str(hf_home / "datasets")}
    try:
        plan_cost(path, 10)  # warm: imports and the file listing's caches
        plans = {"all": plan_cost(path, None), "tenth": plan_cost(path, rows // files // 10)}
        first = first_commit_seconds(path, out, env, first_unit_records)
        per_file = max(1, rss_records // files)
        rss = {"N": peak_rss_mb(path, out, env, per_file, "n"), "10N": peak_rss_mb(path, out, env, per_file * 10, "n10")}
        return {"rows": rows, "files": files, "input_mb": folder_bytes(path) / 1e6, "plans": plans,
                "first_commit_s": first, "first_unit_records": first_unit_records,
                "rss_records": {"N": per_file * files, "10N": per_file * 10 * files}, "peak_rss_mb": rss,
                "hf_cache_growth_bytes": folder_bytes(hf_home)}
    finally:
        shutil.rmtree(out, ignore_errors=True)


def format_scale(result: dict) -> str:
    plans = result["plans"]
    lines = [f"scale bench: {result['rows']:,} rows over {result['files']} Parquet files "
             f"({result['input_mb']:.0f} MB of small JPEGs)"]
    for name, plan in plans.items():
        lines.append(f"plan ({plan['records']:,} rows): {plan['seconds']:.2f} s, {plan['units']} units, "
                     f"{plan['bytes_read'] / 1e6:.2f} MB read")
    lines.append(f"plan time 1/10 rows vs all rows: {plans['tenth']['seconds'] / plans['all']['seconds']:.2f}x "
                 "(1.0 = independent of rows)")
    lines.append(f"time to the first committed unit ({result['first_unit_records']} records, job start included): "
                 f"{result['first_commit_s']:.1f} s")
    rss = result["peak_rss_mb"]
    lines.append(f"peak RSS: {rss['N']:.0f} MB at {result['rss_records']['N']:,} records, {rss['10N']:.0f} MB at "
                 f"{result['rss_records']['10N']:,}: 10N/N = {rss['10N'] / rss['N']:.2f}x")
    lines.append(f"HF datasets cache growth: {result['hf_cache_growth_bytes']} bytes")
    return "\n".join(lines)
