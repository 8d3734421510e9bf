"""`python jobs/bench.py task=e2e`: where the job's time goes, measured side by side in one run.

One dataset (`records` real photos, one JPEG per record, of the common sizes in decoding.REAL_SIZES) cut into two work
units per worker (`job_workers`), so that the workers decode side by side, and one checkpoint (the tiny Kimi demo
tower, or a ViT-B-sized MoonViT with `tower=base`) in `dtype` (bf16 by default, as checkpoints ship):
- the whole job (`Job.run_all`, in this process, after model load) against the tower alone on the same packed
  batches, preprocessed beforehand and timed with the device synchronized: the job should cost little more than its
  tower;
- the job's host-device syncs per batch, counted through the device stage's seam (on CUDA with
  torch.cuda.set_sync_debug_mode, so the implicit ones count too);
- the sink (streamed shards, ids, manifest, under a claim) against a bare `pq.write_table` of the same rows;
- each stage alone on the same records, in images/s: decode (in the isolated child), plan+layout,
  preprocess, tower, assemble, sink;
- the job again with `runtime.overlap=false` (batch by batch) and with `decode.jpeg=device`;
- the decode stage both ways on the same JPEGs (decoding.decode_both_ways);
- the text side of a conversation (render with the checkpoint's chat template + tokenize + expand + mask) on
  LLaVA-like multi-turn conversations with one image, on one core, at two lengths: conversations/s beside the decode
  stage's images/s, and turns/s at both lengths (a cost linear in the turns gives the same turns/s).
"""

from __future__ import annotations

import math
import shutil
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from batchvlm.bench.decoding import REAL_SIZES, decode_both_ways, jpeg_of, photos, timed
from batchvlm.bench.tower import tower_model
from batchvlm.executor.config import JobConfig, RuntimeConfig
from batchvlm.families import ModelConfig
from batchvlm.pipeline.chat import TextConfig
from batchvlm.pipeline.decode import DecodeConfig
from batchvlm.rundir.sink import OutputConfig
from batchvlm.sources.config import dataset_config
from batchvlm.executor.batching import TokenBudgetBatcher
from batchvlm.executor.steps import Assembly, Batching, alone
from batchvlm.executor.job import Parts, rank_job
from batchvlm.executor.worker import plan_and_lay_out
from batchvlm.format.schema import DATA_SCHEMA
from batchvlm.pipeline.chat import ChatRenderer
from batchvlm.pipeline.decode import Decoder
from batchvlm.pipeline.encode import encode_batch
from batchvlm.pipeline.preprocess import preprocess_batch
from batchvlm.records import ImageRef, OutputRow, Outcomes, SourceRecord, Turn, WorkUnit
from batchvlm.rundir.claims import Claims
from batchvlm.rundir.layout import DATA, RunLayout
from batchvlm.rundir.sink import RunSink

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
    return [jpeg_of(pixels, "baseline 4:2:0") for pixels in photos(count, REAL_SIZES)]


def write_dataset(folder: Path, images: list[bytes]) -> Path:
    path = folder / "photos.parquet"
    pq.write_table(pa.table({"id": [f"photo-{i:05d}" for i in range(len(images))], "images": [[b] for b in images],
                             "text": ["<image> a photograph"] * len(images)}), path, row_group_size=16)
    return path


def job_config(path: Path, out: Path, model: ModelConfig, unit_records: int, workers: int, name: str = "e2e",
               overlap: bool = True, jpeg: str = "safe", limit: int | None = None) -> JobConfig:
    return JobConfig(run_name=name, dataset=dataset_config("parquet", path=str(path), unit_records=unit_records,
                                                          limit=limit),
                     model=model, output=OutputConfig(root=str(out)), decode=DecodeConfig(jpeg=jpeg),
                     runtime=RuntimeConfig(progress=False, overlap=overlap, num_workers=workers))


def run_whole(cfg: JobConfig, out: Path) -> tuple[Parts, float]:
    """The job, in this process, its syncs counted; its parts, and its images/s over every record (a ratio over
    quarantined records would measure nothing, so there must be none)."""
    job = rank_job(cfg, out / cfg.run_name)
    with job.parts.stage.syncs.counting(job.parts.device):
        summary = job.run_all()
    if summary["written"] != summary["records_in"]:
        raise RuntimeError(f"the e2e job {cfg.run_name} quarantined records: {summary['by_check']}")
    return job.parts, summary["records_per_s"]


def syncs_of(parts: Parts) -> dict:
    syncs = parts.stage.syncs
    return {"batches": syncs.batches, "waits": syncs.waits, "implicit": syncs.implicit, "per_batch": syncs.per_batch}


def bench_e2e(config) -> dict:
    """`config`: bench.BenchConfig (records, tower, dtype, job_workers, device)."""
    out = Path(tempfile.mkdtemp(prefix="batchvlm-e2e-"))
    try:
        images = photo_jpegs(config.records)
        path = write_dataset(out, images)
        model = tower_model(config, embedding="auto")
        units = math.ceil(config.records / (2 * config.job_workers))

        def run(name: str, **settings) -> tuple[Parts, float]:
            return run_whole(job_config(path, out, model, units, config.job_workers, name, **settings), out)

        # The first job in a process pays one-time costs (thread pools, kernel caches, imports): a short one first,
        # so that the three measured below differ only in their settings.
        run("e2e-warm-up", limit=WARM_UP_RECORDS)
        job, job_rate = run("e2e")
        off, batch_by_batch_rate = run("e2e-off", overlap=False)
        _, device_decode_rate = run("e2e-jpeg", jpeg="device")
        stages, batches, rows = stage_rates(job, images)
        text_side = text_side_rates(job, [record.plans[0] for batch in batches for record in batch.records])
        stages["text (render+tokenize+expand+mask)"] = text_side[TEXT_TURNS[0]]
        tower_s = timed(lambda: [job.stage.encoder(b.pixel_values, b.grid_thw) for b in batches], job.device)[0]
        sink_s, bare_s = sink_against_bare_write(job, rows, out)
        stages["sink"] = 1 / sink_s
        return {"records": config.records, "tower": config.tower, "dtype": config.dtype, "device": str(job.device),
                "workers": config.job_workers, "units": math.ceil(config.records / units),
                "job_images_per_s": job_rate, "tower_images_per_s": config.records / tower_s,
                "batch_by_batch_images_per_s": batch_by_batch_rate, "device_decode_images_per_s": device_decode_rate,
                "syncs": syncs_of(job), "batch_by_batch_syncs": syncs_of(off),
                "sink_rows_per_s": 1 / sink_s, "bare_rows_per_s": 1 / bare_s,
                "decode": decode_both_ways(job.device, job.job.decode, images,
                                           [len(batch.records) for batch in batches]),
                "stages": stages, "text_side": text_side}
    finally:
        shutil.rmtree(out, ignore_errors=True)


def stage_rates(job: Parts, images: list[bytes]) -> tuple[dict, list, list]:
    """Each stage alone on the same records, images/s (the device synchronized around each); returns the packed
    batches and the assembled rows."""
    records = [SourceRecord(f"photo-{i:05d}", "u", "bench", i, "<image> a photograph", [ImageRef(data=image)], seq=i)
               for i, image in enumerate(images)]
    decoder = Decoder(job.job.decode)
    try:
        decode_s, decoded = timed(lambda: [decoder(record.images[0], 0) for record in records], job.device)
    finally:
        decoder.close()
    layout_s, prepared = timed(lambda: [plan_and_lay_out(record, record.text, [image], job.family, job.job, job.text)
                                        for record, image in zip(records, decoded)], job.device)
    batcher = TokenBudgetBatcher(job.job.preprocess.token_budget, job.job.preprocess.max_images_per_batch)
    groups = alone(Batching(batcher), prepared)
    preprocess_s, batches = timed(lambda: [preprocess_batch(group.records, job.stage.preprocessor)
                                           for group in groups], job.device)
    dtype = job.assembler.embed_dtype
    encode_s, encoded = timed(lambda: [e for batch in batches for e in encode_batch(job.stage.encoder, batch, dtype)],
                              job.device)
    assemble_s, assembled = timed(lambda: alone(Assembly(job.assembler), [Outcomes(encoded)]), job.device)
    rows = [row.values for item in assembled for row in item.rows]
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
        rates[turns] = CONVERSATIONS / min(timed(layouts, job.device)[0] for _ in range(3))
    return rates


def sink_against_bare_write(job: Parts, rows: list[dict], out: Path) -> tuple[float, float]:
    """Seconds per row of each, over SINK_ROWS rows (the records' rows repeated with their own ids): a unit of
    a real size, so the commit's fixed cost (fsyncs, checksums, manifest) weighs as it does in a job."""
    rows = [{**rows[i % len(rows)], "id": f"row-{i:06d}", "row": i} for i in range(SINK_ROWS)]
    metadata = job.shard_metadata()
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

    return timed(through_sink, job.device)[0] / len(rows), timed(bare_write, job.device)[0] / len(rows)


def format_e2e(result: dict) -> str:
    decode, syncs, off = result["decode"], result["syncs"], result["batch_by_batch_syncs"]
    lines = [f"e2e bench: {result['records']} records of real photos (JPEG), {result['tower']} Kimi tower in "
             f"{result['dtype']}, device {result['device']}, {result['workers']} workers over {result['units']} units",
             f"end-to-end {result['job_images_per_s']:.1f} images/s vs tower alone {result['tower_images_per_s']:.1f}: "
             f"{result['job_images_per_s'] / result['tower_images_per_s']:.2f}x",
             f"overlap: end-to-end {result['job_images_per_s']:.2f} images/s vs batch by batch (runtime.overlap=false) "
             f"{result['batch_by_batch_images_per_s']:.2f}: "
             f"{result['job_images_per_s'] / result['batch_by_batch_images_per_s']:.2f}x; with decode.jpeg=device "
             f"{result['device_decode_images_per_s']:.2f}: "
             f"{result['device_decode_images_per_s'] / result['job_images_per_s']:.2f}x",
             f"host-device syncs per batch: overlap {syncs['per_batch']:.2f} ({syncs['waits']} waits, "
             f"{syncs['implicit']} implicit over {syncs['batches']} batches), batch by batch {off['per_batch']:.2f} "
             f"({off['waits']} waits, {off['implicit']} implicit over {off['batches']} batches)",
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
