"""`python jobs/bench.py task=e2e`: where the job's time goes, measured side by side in one run.

One dataset (`records` 512x384 JPEGs of real photos, one per record) and one checkpoint (the tiny
Kimi demo tower, or a ViT-B-sized MoonViT with `tower=base`):
- the whole job (`Job.run_all`, in this process, after model load) against the tower alone on the
  same packed batches, preprocessed beforehand: the job should cost little more than its tower;
- the sink (streamed shards, ids, manifest, under a claim) against a bare `pq.write_table` of the
  same rows;
- each stage alone on the same records, in images/s: decode (in the isolated child), plan+layout,
  preprocess, tower, assemble, sink;
- the job again with `runtime.overlap=false` (batch by batch) and with `decode.jpeg=device`;
- the decode stage both ways on the same JPEGs: the safe path (in the isolated child, as the workers run it)
  against torchvision's batched decode on the job's device (CUDA when present, else the CPU), in the same
  groups as the packed batches, plus the worker's header check that routes a JPEG to it;
- the text side of a conversation (render with the checkpoint's chat template + tokenize + expand + mask) on
  LLaVA-like multi-turn conversations with one image, on one core, at two lengths: conversations/s beside the decode
  stage's images/s, and turns/s at both lengths (a cost linear in the turns gives the same turns/s).
"""

from __future__ import annotations

import dataclasses
import io
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from PIL import Image

from batchvlm.config import (TINY, DatasetConfig, DecodeConfig, JobConfig, ModelConfig, OutputConfig, RuntimeConfig,
                             TextConfig)
from batchvlm.demo import DEMO_VERSION, build_once, home, photographs
from batchvlm.executor.batching import TokenBudgetBatcher
from batchvlm.executor.job import Parts, rank_job
from batchvlm.executor.worker import plan_and_lay_out
from batchvlm.families import kimi_k25
from batchvlm.format.schema import DATA_SCHEMA
from batchvlm.pipeline.assemble import data_row
from batchvlm.pipeline.chat import ChatRenderer
from batchvlm.pipeline.decode import Decoder
from batchvlm.pipeline.encode import encode_batch
from batchvlm.pipeline.jpeg import JpegBatchDecoder, deferred
from batchvlm.pipeline.preprocess import preprocess_batch
from batchvlm.records import ImageRef, OutputRow, PreparedRecord, SourceRecord, Turn, WorkUnit
from batchvlm.rundir.claims import Claims
from batchvlm.rundir.layout import DATA, RunLayout
from batchvlm.rundir.sink import RunSink

SIZE = (384, 512)  # height, width
SINK_ROWS = 2000
WARM_UP_RECORDS = 4
CONVERSATIONS = 400
TEXT_TURNS = (4, 32)
"""Turns per conversation the text side is timed at (question-answer pairs x 2)."""
QUESTIONS = ["What is shown in the image?", "What colours stand out, and where?", "How many objects can you count?",
             "Is it day or night? Explain briefly.", "What might happen next in this scene?"]
ANSWERS = ["The image shows {n} objects on a table, lit from the left; the background is out of focus.",
           "Mostly red and white: a cup in the middle, a saucer under it, and a spoon at {n} o'clock.",
           "I count {n} of them, though two overlap near the lower edge of the frame.",
           "Daylight: the shadows are short and sharp, so it is around noon, maybe {n} pm."]


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


def job_config(path: Path, out: Path, model: ModelConfig, records: int, name: str = "e2e", overlap: bool = True,
               jpeg: str = "safe", limit: int | None = None) -> JobConfig:
    return JobConfig(run_name=name, dataset=DatasetConfig(kind="parquet", path=str(path), unit_records=records,
                                                          limit=limit),
                     model=model, output=OutputConfig(root=str(out)), decode=DecodeConfig(jpeg=jpeg),
                     runtime=RuntimeConfig(progress=False, overlap=overlap))


def run_whole(cfg: JobConfig, out: Path) -> tuple[Parts, float]:
    """The job, in this process; its parts, and its images/s over every record (a ratio over quarantined records
    would measure nothing, so there must be none)."""
    job = rank_job(cfg, out / cfg.run_name)
    summary = job.run_all()
    if summary["written"] != summary["records_in"]:
        raise RuntimeError(f"the e2e job {cfg.run_name} quarantined records: {summary['by_check']}")
    return job.parts, summary["records_per_s"]


def timed(run) -> tuple[float, object]:
    started = time.perf_counter()
    result = run()
    return time.perf_counter() - started, result


def base_checkpoint() -> Path:
    """The tiny Kimi checkpoint with a ViT-B-sized tower, built once: the tower must cost what a real one does."""
    return build_once(home() / f"demo-{DEMO_VERSION}" / "kimi_k25_base", kimi_k25.write_base_checkpoint)


def bench_e2e(config) -> dict:
    """`config`: bench.BenchConfig (records, tower, device)."""
    out = Path(tempfile.mkdtemp(prefix="batchvlm-e2e-"))
    try:
        images = photo_jpegs(config.records)
        path = write_dataset(out, images)
        model = ModelConfig(path=str(base_checkpoint()) if config.tower == "base" else TINY, device=config.device)
        # The first job in a process pays one-time costs (thread pools, kernel caches, imports): a short one first,
        # so that the three measured below differ only in their settings.
        run_whole(job_config(path, out, model, config.records, "e2e-warm-up", limit=WARM_UP_RECORDS), out)
        job, job_rate = run_whole(job_config(path, out, model, config.records), out)
        _, batch_by_batch_rate = run_whole(job_config(path, out, model, config.records, "e2e-off", overlap=False), out)
        _, device_decode_rate = run_whole(job_config(path, out, model, config.records, "e2e-jpeg", jpeg="device"), out)
        stages, batches, rows = stage_rates(job, images)
        text_side = text_side_rates(job, [record.plans[0] for batch in batches for record in batch.records])
        stages["text (render+tokenize+expand+mask)"] = text_side[TEXT_TURNS[0]]
        tower_s = sum(timed(lambda b=b: job.stage.encoder(b.pixel_values, b.grid_thw))[0] for b in batches)
        sink_s, bare_s = sink_against_bare_write(job, rows, out)
        stages["sink"] = 1 / sink_s
        return {"records": config.records, "tower": config.tower, "device": str(job.device),
                "job_images_per_s": job_rate, "tower_images_per_s": config.records / tower_s,
                "batch_by_batch_images_per_s": batch_by_batch_rate, "device_decode_images_per_s": device_decode_rate,
                "sink_rows_per_s": 1 / sink_s, "bare_rows_per_s": 1 / bare_s,
                "decode": decode_both_ways(job, images, [len(batch.records) for batch in batches]),
                "stages": stages, "text_side": text_side}
    finally:
        shutil.rmtree(out, ignore_errors=True)


def stage_rates(job: Parts, images: list[bytes]) -> tuple[dict, list, list]:
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
    preprocess_s, batches = timed(lambda: [preprocess_batch(group, job.stage.preprocessor) for group in groups])
    dtype, sizes = job.assembler.embed_dtype, job.assembler.hidden_sizes
    encode_s, encoded = timed(lambda: [e for batch in batches for e in encode_batch(job.stage.encoder, batch, dtype)])
    assemble_s, rows = timed(lambda: [data_row(e, dtype, sizes) for e in encoded])
    count = len(images)
    return ({"decode": count / decode_s, "plan+layout": count / layout_s,
             "preprocess": count / preprocess_s, "tower+checks": count / encode_s, "assemble": count / assemble_s},
            batches, rows)


def llava_like(index: int, turns: int) -> list[Turn]:
    """A LLaVA-like conversation: the image before the first question, then `turns` / 2 question-answer rounds."""
    conversation = []
    for k in range(turns // 2):
        question = QUESTIONS[(index + k) % len(QUESTIONS)]
        conversation += [Turn("user", (None, "\n" + question) if k == 0 else (question,)),
                         Turn("assistant", (ANSWERS[(index + k) % len(ANSWERS)].format(n=index % 12 + k),))]
    return conversation


def text_side_rates(job: Parts, plans: list) -> dict[int, float]:
    """Conversations/s of the text side at each of TEXT_TURNS, the same image plans cycled, best of 3 passes (one
    thread: the fast tokenizer encodes one text on the calling thread)."""
    chat = ChatRenderer(job.family, job.family.tokenizer.chat_template, TextConfig(), "llava")
    rates = {}
    for turns in TEXT_TURNS:
        conversations = [llava_like(i, turns) for i in range(CONVERSATIONS)]
        layouts = lambda: [chat.lay_out(c, [plans[i % len(plans)]]) for i, c in enumerate(conversations)]  # noqa: E731
        rates[turns] = CONVERSATIONS / min(timed(layouts)[0] for _ in range(3))
    return rates


def decode_both_ways(job: Parts, images: list[bytes], group_sizes: list[int]) -> dict:
    """images/s of the safe path (in the isolated child, one image at a time, as a worker runs it), of the worker's
    header check, and of the batched decode on the job's device in the packed batches' groups (after one warm-up
    group: nvJPEG's first call sets up its handles)."""
    cfg = dataclasses.replace(job.job.decode, jpeg="device")
    safe = Decoder(dataclasses.replace(cfg, jpeg="safe"))
    try:
        safe_s, reference = timed(lambda: [safe(ImageRef(data=image), 0) for image in images])
        header_s, jpegs = timed(lambda: [deferred(image, cfg) for image in images])
        if None in jpegs:
            raise RuntimeError("the e2e JPEGs must all be deferred to the batched decode")
        records = [PreparedRecord(SourceRecord(f"photo-{i:05d}", "u", "bench", i, "", []), [jpeg], [], None)
                   for i, jpeg in enumerate(jpegs)]
        starts = np.cumsum([0] + group_sizes)
        groups = [records[start:stop] for start, stop in zip(starts[:-1], starts[1:])]
        batched = JpegBatchDecoder(job.device, safe)
        batched(groups[0])

        def decode_all() -> list[PreparedRecord]:
            decoded = [batched(group) for group in groups]
            if job.device.type == "cuda":
                torch.cuda.synchronize(job.device)
            if any(refused for _, refused in decoded):
                raise RuntimeError("the batched decode refused an e2e JPEG")
            return [record for kept, _ in decoded for record in kept]

        batched_s, decoded = timed(decode_all)
    finally:
        safe.close()
    count = len(images)
    # nvJPEG is not libjpeg-turbo: on CUDA this is the measured answer to "the same pixels?"
    levels = max(int(np.abs(ours.images[0].on_host().astype(np.int16) - safe_image.pixels).max())
                 for ours, safe_image in zip(decoded, reference))
    return {"device": str(job.device), "safe_images_per_s": count / safe_s, "header_images_per_s": count / header_s,
            "batched_images_per_s": count / batched_s, "max_levels": levels}


def sink_against_bare_write(job: Parts, rows: list[dict], out: Path) -> tuple[float, float]:
    """Seconds per row of each, over SINK_ROWS rows (the records' rows repeated with their own ids): a unit of
    a real size, so the commit's fixed cost (fsyncs, checksums, manifest) weighs as it does in a job."""
    rows = [{**rows[i % len(rows)], "id": f"row-{i:06d}", "row": i} for i in range(SINK_ROWS)]
    metadata = job.run.schema_metadata(job.assembler.hidden_sizes)
    layout = RunLayout(out / "sink")
    claims = Claims(layout.claims, "rank00000-bench", 60)
    sink = RunSink(layout, metadata, job.job.output.compression, claims, dedup_buckets=1)
    unit = WorkUnit("bench-00000000", "bench", 0, len(rows))

    def through_sink():
        sink.start_unit(unit, claims.try_claim(unit.unit_id))
        for seq, row in enumerate(rows):
            sink.add(OutputRow(SourceRecord(row["id"], unit.unit_id, "bench", seq, "", [], seq=seq), DATA, row, {}))
        sink.end_unit(unit, len(rows))

    def bare_write():
        table = pa.Table.from_pylist(rows, schema=DATA_SCHEMA.with_metadata(metadata))
        pq.write_table(table, out / "bare.parquet", compression=job.job.output.compression)

    return timed(through_sink)[0] / len(rows), timed(bare_write)[0] / len(rows)


def format_e2e(result: dict) -> str:
    decode = result["decode"]
    lines = [f"e2e bench: {result['records']} records of 512x384 JPEG, {result['tower']} Kimi tower, "
             f"device {result['device']}",
             f"end-to-end {result['job_images_per_s']:.1f} images/s vs tower alone {result['tower_images_per_s']:.1f}: "
             f"{result['job_images_per_s'] / result['tower_images_per_s']:.2f}x",
             f"overlap: end-to-end {result['job_images_per_s']:.2f} images/s vs batch by batch (runtime.overlap=false) "
             f"{result['batch_by_batch_images_per_s']:.2f}: "
             f"{result['job_images_per_s'] / result['batch_by_batch_images_per_s']:.2f}x; with decode.jpeg=device "
             f"{result['device_decode_images_per_s']:.2f}: "
             f"{result['device_decode_images_per_s'] / result['job_images_per_s']:.2f}x",
             f"decode: safe path (isolated child) {decode['safe_images_per_s']:.1f} images/s vs batched torchvision on "
             f"{decode['device']} {decode['batched_images_per_s']:.1f}: "
             f"{decode['batched_images_per_s'] / decode['safe_images_per_s']:.2f}x "
             f"(+ the worker's header check, {decode['header_images_per_s']:.0f} images/s); "
             f"pixels differ by at most {decode['max_levels']} levels",
             f"sink {result['sink_rows_per_s']:.0f} rows/s vs bare pq.write_table {result['bare_rows_per_s']:.0f}: "
             f"{result['sink_rows_per_s'] / result['bare_rows_per_s']:.2f}x",
             "stages alone (images/s; the text side in conversations/s of one image and "
             f"{TEXT_TURNS[0]} turns): " + ", ".join(f"{name} {rate:.1f}" for name, rate in result["stages"].items()),
             _text_side_line(result)]
    return "\n".join(lines)


def _text_side_line(result: dict) -> str:
    rates, decode = result["text_side"], result["stages"]["decode"]
    short, long = TEXT_TURNS
    return (f"text side (render + tokenize + expand + mask, one core, LLaVA-like): {rates[short]:.0f} conversations/s "
            f"at {short} turns vs decode {decode:.1f} images/s: {rates[short] / decode:.1f}x; turns/s at {short} and "
            f"{long} turns: {rates[short] * short:.0f} and {rates[long] * long:.0f} "
            f"({rates[long] * long / (rates[short] * short):.2f}x: linear in the turns)")
