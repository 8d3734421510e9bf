"""`python jobs/bench.py task=e2e`: where the job's time goes, measured side by side in one run.

One dataset (`records` 512x384 JPEGs of real photos, one per record) and one checkpoint (the tiny
Kimi demo tower, or a ViT-B-sized MoonViT with `tower=base`):
- the whole job (`Job.run_all`, in this process, after model load) against the tower alone on the
  same packed batches, preprocessed beforehand: the job should cost little more than its tower;
- the sink (streamed shards, ids, manifest, under a claim) against a bare `pq.write_table` of the
  same rows;
- each stage alone on the same records, in images/s: decode (in the isolated child), plan+layout,
  preprocess, tower, assemble, sink.
"""

from __future__ import annotations

import io
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from batchvlm.assemble import DATA_SCHEMA, data_row
from batchvlm.claims import Claims
from batchvlm.config import DatasetConfig, JobConfig, ModelConfig, OutputConfig, RuntimeConfig
from batchvlm.decode import Decoder
from batchvlm.demo import photographs
from batchvlm.driver import Job, TokenBudgetBatcher, plan_and_lay_out
from batchvlm.encode import encode_batch
from batchvlm.preprocess import pack
from batchvlm.records import ImageRef, SourceRecord, WorkUnit
from batchvlm.sink import RunSink

SIZE = (384, 512)  # height, width
SINK_ROWS = 2000


def photo_jpegs(count: int) -> list[bytes]:
    data = photographs()
    photos = [data.astronaut(), data.coffee(), data.chelsea(), data.rocket(), data.hubble_deep_field(),
              data.retina()]
    images = []
    for index in range(count):
        pixels = np.asarray(Image.fromarray(photos[index % len(photos)]).resize(SIZE[::-1]))
        buffer = io.BytesIO()
        Image.fromarray(np.roll(pixels, index, axis=1)).save(buffer, format="JPEG", quality=90)
        images.append(buffer.getvalue())
    return images


def write_dataset(folder: Path, images: list[bytes]) -> Path:
    path = folder / "photos.parquet"
    pq.write_table(pa.table({"id": [f"photo-{i:05d}" for i in range(len(images))], "images": [[b] for b in images],
                             "text": ["<image> a photograph"] * len(images)}), path, row_group_size=256)
    return path


def job_config(path: Path, out: Path, model: ModelConfig, records: int) -> JobConfig:
    return JobConfig(run_name="e2e", dataset=DatasetConfig(kind="parquet", path=str(path), unit_records=records),
                     model=model, output=OutputConfig(root=str(out)), runtime=RuntimeConfig(progress=False))


def timed(run) -> tuple[float, object]:
    started = time.perf_counter()
    result = run()
    return time.perf_counter() - started, result


def bench_e2e(config) -> dict:
    """`config`: bench.BenchConfig (records, tower, device)."""
    from batchvlm.demo import base_kimi_checkpoint

    out = Path(tempfile.mkdtemp(prefix="batchvlm-e2e-"))
    try:
        images = photo_jpegs(config.records)
        path = write_dataset(out, images)
        model = ModelConfig(path=str(base_kimi_checkpoint()) if config.tower == "base" else None, device=config.device)
        job = Job(job_config(path, out, model, config.records), out / "e2e")
        summary = job.run_all()
        if summary["written"] != config.records:  # a ratio over quarantined records would measure nothing
            raise RuntimeError(f"the e2e job quarantined records: {summary['by_check']}")
        stages, batches, rows = stage_rates(job, images)
        tower_s = sum(timed(lambda b=b: job.on_device.encoder(b.pixel_values, b.grid_thw))[0] for b in batches)
        sink_s, bare_s = sink_against_bare_write(job, rows, out)
        stages["sink"] = 1 / sink_s
        return {"records": config.records, "tower": config.tower, "device": str(job.device),
                "job_images_per_s": summary["records_per_s"], "tower_images_per_s": config.records / tower_s,
                "sink_rows_per_s": 1 / sink_s, "bare_rows_per_s": 1 / bare_s,
                "stages": stages}
    finally:
        shutil.rmtree(out, ignore_errors=True)


def stage_rates(job: Job, images: list[bytes]) -> tuple[dict, list, list]:
    """Each stage alone on the same records, images/s; returns the packed batches and the assembled rows."""
    records = [SourceRecord(f"photo-{i:05d}", "u", "bench", i, "<image> a photograph", [ImageRef(data=image)], seq=i)
               for i, image in enumerate(images)]
    decoder = Decoder(job.job.decode)
    try:
        decode_s, decoded = timed(lambda: [decoder(record.images[0], 0) for record in records])
    finally:
        decoder.close()
    layout_s, prepared = timed(lambda: [plan_and_lay_out(record, record.text, [image], job.family, job.job)
                                        for record, image in zip(records, decoded)])
    batcher = TokenBudgetBatcher(job.job.preprocess.token_budget, job.job.preprocess.max_images_per_batch)
    groups = [closed for record in prepared if (closed := batcher.add(record))] + [batcher.flush()]
    preprocess_s, batches = timed(lambda: [pack(group, job.on_device.preprocessor) for group in groups])
    encode_s, encoded = timed(lambda: [e for batch in batches for e in encode_batch(job.on_device.encoder, batch,
                                                                                    job.embed_dtype)])
    assemble_s, rows = timed(lambda: [data_row(e, job.embed_dtype, job.hidden_sizes) for e in encoded])
    count = len(images)
    return ({"decode": count / decode_s, "plan+layout": count / layout_s,
             "preprocess": count / preprocess_s, "tower+checks": count / encode_s, "assemble": count / assemble_s},
            batches, rows)


def sink_against_bare_write(job: Job, rows: list[dict], out: Path) -> tuple[float, float]:
    """Seconds per row of each, over SINK_ROWS rows (the records' rows repeated with their own ids): a unit of
    a real size, so the commit's fixed cost (fsyncs, checksums, manifest) weighs as it does in a job."""
    rows = [{**rows[i % len(rows)], "id": f"row-{i:06d}", "row": i} for i in range(SINK_ROWS)]
    metadata = job.run.schema_metadata(job.hidden_sizes)
    sink = RunSink(out / "sink", metadata, job.job.output.compression)
    sink.claims = Claims(out / "sink" / "claims", "rank00000-bench", 60)
    unit = WorkUnit("bench-00000000", "bench", 0, len(rows))

    def through_sink():
        sink.start_unit(unit, sink.claims.try_claim(unit.unit_id))
        for seq, row in enumerate(rows):
            sink.add(unit.unit_id, seq, "data", row, {})
        sink.end_unit(unit, len(rows))

    def bare_write():
        table = pa.Table.from_pylist(rows, schema=DATA_SCHEMA.with_metadata(metadata))
        pq.write_table(table, out / "bare.parquet", compression=job.job.output.compression)

    return timed(through_sink)[0] / len(rows), timed(bare_write)[0] / len(rows)


def format_e2e(result: dict) -> str:
    lines = [f"e2e bench: {result['records']} records of 512x384 JPEG, {result['tower']} Kimi tower, "
             f"device {result['device']}",
             f"end-to-end {result['job_images_per_s']:.1f} images/s vs tower alone {result['tower_images_per_s']:.1f}: "
             f"{result['job_images_per_s'] / result['tower_images_per_s']:.2f}x",
             f"sink {result['sink_rows_per_s']:.0f} rows/s vs bare pq.write_table {result['bare_rows_per_s']:.0f}: "
             f"{result['sink_rows_per_s'] / result['bare_rows_per_s']:.2f}x",
             "stages alone (images/s): " + ", ".join(f"{name} {rate:.1f}" for name, rate in result["stages"].items())]
    return "\n".join(lines)

