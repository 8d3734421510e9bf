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
- the job again with `runtime.overlap=false` (batch by batch; after a whole warm-up job) and with
  `decode.jpeg=device`, and how far the latter's
  embeddings are from the reference's (the safe path's pixels; nvJPEG's differ on 4:2:0 JPEGs);
- the host ceiling (bench/host.py): the job with a zero-cost device stage against the decode stage times the workers;
- the decode stage both ways on the same JPEGs (decoding.decode_both_ways);
- the text side of a conversation (render with the checkpoint's chat template + tokenize + expand + mask) on
  LLaVA-like multi-turn conversations with one image, on one core, at two lengths: conversations/s beside the decode
  stage's images/s, and turns/s at both lengths (a cost linear in the turns gives the same turns/s).
With `stages=false` the stages alone, the text side and the sink are left out (the GPU check's runs).
"""

from __future__ import annotations

import math
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from batchvlm.bench.decoding import REAL_SIZES, decode_both_ways, jpeg_of, photos, timed
from batchvlm.bench.host import without_device_work
from batchvlm.bench.tasks import bench_device
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
from batchvlm.format.schema import DATA_SCHEMA, EMBED_DTYPES
from batchvlm.pipeline.chat import ChatRenderer
from batchvlm.pipeline.decode import Decoder
from batchvlm.pipeline.encode import encode_batch
from batchvlm.pipeline.preprocess import preprocess_batch
from batchvlm.records import ImageRef, OutputRow, Outcomes, SourceRecord, Turn, WorkUnit
from batchvlm.rundir.claims import Claims
from batchvlm.rundir.layout import DATA, RunLayout
from batchvlm.rundir.sink import RunSink

SINK_ROWS = 2000
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


def run_whole(cfg: JobConfig, out: Path, zero_cost: bool = False) -> tuple[Parts, float]:
    """The job, in this process, its syncs counted (with `zero_cost`, its device stage's work taken out:
    host.without_device_work); its parts, and its images/s in steady state: from the first batch handed to the device
    to the last row handed to the writer, over the records after that batch's. The plan, the workers' start, the
    duplicate pass and the totals cost the same whatever the records, and on a bench's few records would stand for
    the pipeline. A ratio over quarantined records would measure nothing, so there must be none."""
    job = rank_job(cfg, out / cfg.run_name)
    if zero_cost:
        without_device_work(job.parts)
    stage, embed, first, ended = job.parts.stage, job.embed, [], []

    def timed_submit(records):
        if records and not first:
            first.append((time.perf_counter(), len(records)))
        return submit(records)

    def timed_embed(*args):
        try:
            return embed(*args)
        finally:
            ended.append(time.perf_counter())

    submit, stage.submit, job.embed = stage.submit, timed_submit, timed_embed
    with stage.syncs.counting(job.parts.device):
        summary = job.run_all()
    if summary["written"] != summary["records_in"]:
        raise RuntimeError(f"the e2e job {cfg.run_name} quarantined records: {summary['by_check']}")
    (started, ahead), records = first[0], summary["records_in"]
    return job.parts, ((records - ahead) / (ended[-1] - started) if records > ahead else summary["records_per_s"])


def embeddings_of(run_dir: Path) -> dict[str, np.ndarray]:
    """Each written record's image embeddings (as float32), by id."""
    embeds = {}
    for path in sorted((run_dir / DATA).glob("*.parquet")):
        table = pq.read_table(path, columns=["id", "image_embeds"])
        dtype = EMBED_DTYPES[table.schema.metadata[b"batchvlm.embed_dtype"].decode()]
        for key, blob in zip(table.column("id").to_pylist(), table.column("image_embeds").to_pylist()):
            embeds[key] = torch.frombuffer(bytearray(blob), dtype=dtype).float().numpy()
    return embeds


def embedding_difference(reference: Path, other: Path) -> dict:
    """How far `other`'s embeddings are from `reference`'s, record by record: the largest absolute difference, and it
    over the reference's largest magnitude."""
    ours, theirs = embeddings_of(reference), embeddings_of(other)
    if set(ours) != set(theirs):
        raise RuntimeError(f"{other} wrote other records than {reference}")
    largest = max((float(np.abs(values).max(initial=0.0)) for values in ours.values()), default=0.0)
    worst = max((float(np.abs(ours[key] - theirs[key]).max(initial=0.0)) for key in ours), default=0.0)
    return {"max_abs": worst, "relative": worst / largest if largest else 0.0}


def host_ceiling(path: Path, out: Path, model: ModelConfig, units: int, workers: int, decode_rate: float) -> dict:
    """The job with a zero-cost device stage (host.py) against the decode stage (one process) times the workers."""
    _, rate = run_whole(job_config(path, out, model, units, workers, f"e2e-host-{workers}"), out, zero_cost=True)
    return {"workers": workers, "job_images_per_s": rate, "decode_images_per_s": decode_rate,
            "ratio": rate / (decode_rate * workers)}


def syncs_of(parts: Parts) -> dict:
    syncs = parts.stage.syncs
    return {"batches": syncs.batches, "waits": syncs.waits, "implicit": syncs.implicit, "per_batch": syncs.per_batch}


def bench_inputs(config, out: Path) -> tuple[list[bytes], Path, ModelConfig, int]:
    """The bench's JPEGs, their dataset in `out`, its checkpoint, and its records per work unit (two units a worker)."""
    images = photo_jpegs(config.records)
    return (images, write_dataset(out, images), tower_model(config, embedding="auto"),
            math.ceil(config.records / (2 * config.job_workers)))


def bench_host(config) -> dict:
    """`python jobs/bench.py task=host`: the e2e bench's host ceiling alone (no tower run), `job_workers` workers,
    the decode stage and the job each the best of `repeats`."""
    out = Path(tempfile.mkdtemp(prefix="batchvlm-host-"))
    try:
        images, path, model, units = bench_inputs(config, out)
        device = bench_device(config.device)
        host_ceiling(path, out / "warm-up", model, units, config.job_workers, 1.0)
        decode = max(decode_both_ways(device, DecodeConfig(), images, [len(images)])["safe_images_per_s"]
                     for _ in range(config.repeats))
        runs = [host_ceiling(path, out / f"run-{k}", model, units, config.job_workers, decode)
                for k in range(config.repeats)]
        return {**max(runs, key=lambda run: run["ratio"]), "records": config.records, "repeats": config.repeats,
                "device": str(device), "all": [run["job_images_per_s"] for run in runs]}
    finally:
        shutil.rmtree(out, ignore_errors=True)


def format_host(result: dict) -> str:
    return (f"host ceiling: {result['records']} real photos, {result['workers']} workers, zero-cost tower and "
            f"preprocessing on {result['device']}, best of {result['repeats']} "
            f"({', '.join(f'{rate:.1f}' for rate in result['all'])} images/s)\n"
            f"job {result['job_images_per_s']:.1f} images/s vs decode stage {result['decode_images_per_s']:.1f} x "
            f"{result['workers']} workers: {result['ratio']:.2f}x")


def bench_e2e(config) -> dict:
    """`config`: bench.BenchConfig (records, tower, dtype, job_workers, device, stages)."""
    out = Path(tempfile.mkdtemp(prefix="batchvlm-e2e-"))
    try:
        images, path, model, units = bench_inputs(config, out)

        def run(name: str, **settings) -> tuple[Parts, float]:
            return run_whole(job_config(path, out, model, units, config.job_workers, name, **settings), out)

        # The first job in a process pays one-time costs (thread pools, kernels compiled for each shape and argument,
        # allocator and pinned pools): a whole one first, so that the jobs measured below differ only in their
        # settings (the order once favoured whichever ran later: overlap, first, measured 0.71-0.81x batch by batch).
        run("e2e-warm-up")
        job, job_rate = run("e2e")
        off, batch_by_batch_rate = run("e2e-off", overlap=False)
        _, device_decode_rate = run("e2e-jpeg", jpeg="device")
        batches = packed_batches_of(job, images)
        tower_s = timed(lambda: [job.stage.encoder(b.pixel_values, b.grid_thw) for b in batches], job.device)[0]
        decode = decode_both_ways(job.device, job.job.decode, images, [len(batch.records) for batch in batches])
        result = {"records": config.records, "tower": config.tower, "dtype": config.dtype, "device": str(job.device),
                  "workers": config.job_workers, "units": math.ceil(config.records / units),
                  "job_images_per_s": job_rate, "tower_images_per_s": config.records / tower_s,
                  "batch_by_batch_images_per_s": batch_by_batch_rate, "device_decode_images_per_s": device_decode_rate,
                  "device_decode_embeddings": embedding_difference(out / "e2e", out / "e2e-jpeg"),
                  "host": host_ceiling(path, out, model, units, config.job_workers, decode["safe_images_per_s"]),
                  "syncs": syncs_of(job), "batch_by_batch_syncs": syncs_of(off), "decode": decode}
        if config.stages:
            result.update(stage_report(job, images, out))
        return result
    finally:
        shutil.rmtree(out, ignore_errors=True)


def stage_report(job: Parts, images: list[bytes], out: Path) -> dict:
    """Each stage alone, the text side, and the sink against a bare write."""
    stages, batches, rows = stage_rates(job, images)
    text_side = text_side_rates(job, [record.plans[0] for batch in batches for record in batch.records])
    stages["text (render+tokenize+expand+mask)"] = text_side[TEXT_TURNS[0]]
    sink_s, bare_s = sink_against_bare_write(job, rows, out)
    stages["sink"] = 1 / sink_s
    return {"stages": stages, "text_side": text_side, "sink_rows_per_s": 1 / sink_s, "bare_rows_per_s": 1 / bare_s}


def packed_batches_of(job: Parts, images: list[bytes]) -> list:
    """The records' packed batches as the job makes them (decoded, planned, batched by its budget, preprocessed)."""
    records = bench_records(images)
    decoder = Decoder(job.job.decode)
    try:
        prepared = [plan_and_lay_out(record, record.text, [decoder(record.images[0], 0)], job.family, job.job,
                                     job.text) for record in records]
    finally:
        decoder.close()
    return [preprocess_batch(group, job.stage.preprocessor) for group in budget_groups(job, prepared)]


def bench_records(images: list[bytes]) -> list[SourceRecord]:
    return [SourceRecord(f"photo-{i:05d}", "u", "bench", i, "<image> a photograph", [ImageRef(data=image)], seq=i)
            for i, image in enumerate(images)]


def budget_groups(job: Parts, prepared: list) -> list[list]:
    """The records batched by the job's patch budget, as its Batching step does."""
    batcher = TokenBudgetBatcher(job.job.preprocess.token_budget, job.job.preprocess.max_images_per_batch)
    return [group.records for group in alone(Batching(batcher), prepared)]


def stage_rates(job: Parts, images: list[bytes]) -> tuple[dict, list, list]:
    """Each stage alone on the same records, images/s (the device synchronized around each); returns the packed
    batches and the assembled rows."""
    records = bench_records(images)
    decoder = Decoder(job.job.decode)
    try:
        decode_s, decoded = timed(lambda: [decoder(record.images[0], 0) for record in records], job.device)
    finally:
        decoder.close()
    layout_s, prepared = timed(lambda: [plan_and_lay_out(record, record.text, [image], job.family, job.job, job.text)
                                        for record, image in zip(records, decoded)], job.device)
    groups = budget_groups(job, prepared)
    preprocess_s, batches = timed(lambda: [preprocess_batch(group, job.stage.preprocessor) for group in groups],
                                  job.device)
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
    decode, syncs, off, host = result["decode"], result["syncs"], result["batch_by_batch_syncs"], result["host"]
    embeds = result["device_decode_embeddings"]
    lines = [f"e2e bench: {result['records']} records of real photos (JPEG), {result['tower']} Kimi tower in "
             f"{result['dtype']}, device {result['device']}, {result['workers']} workers over {result['units']} units",
             f"end-to-end {result['job_images_per_s']:.1f} images/s vs tower alone {result['tower_images_per_s']:.1f}: "
             f"{result['job_images_per_s'] / result['tower_images_per_s']:.2f}x",
             f"host ceiling (zero-cost tower and preprocessing): {host['job_images_per_s']:.1f} images/s vs decode "
             f"stage {host['decode_images_per_s']:.1f} x {host['workers']} workers: {host['ratio']:.2f}x",
             f"overlap: end-to-end {result['job_images_per_s']:.2f} images/s vs batch by batch (runtime.overlap=false) "
             f"{result['batch_by_batch_images_per_s']:.2f}: "
             f"{result['job_images_per_s'] / result['batch_by_batch_images_per_s']:.2f}x; with decode.jpeg=device "
             f"{result['device_decode_images_per_s']:.2f}: "
             f"{result['device_decode_images_per_s'] / result['job_images_per_s']:.2f}x, its embeddings off the safe "
             f"path's by at most {embeds['max_abs']:.3g} ({embeds['relative']:.2%} of their largest magnitude)",
             f"host-device syncs per batch: overlap {syncs['per_batch']:.2f} ({syncs['waits']} waits, "
             f"{syncs['implicit']} implicit over {syncs['batches']} batches), batch by batch {off['per_batch']:.2f} "
             f"({off['waits']} waits, {off['implicit']} implicit over {off['batches']} batches)",
             f"decode: safe path (isolated child) {decode['safe_images_per_s']:.1f} images/s vs batched torchvision on "
             f"{decode['device']} {decode['batched_images_per_s']:.1f}: "
             f"{decode['batched_images_per_s'] / decode['safe_images_per_s']:.2f}x "
             f"(+ the worker's header check, {decode['header_images_per_s']:.0f} images/s); "
             f"pixels differ by at most {decode['max_levels']} levels"]
    if "stages" in result:
        lines += [f"sink {result['sink_rows_per_s']:.0f} rows/s vs bare pq.write_table {result['bare_rows_per_s']:.0f}: "
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
