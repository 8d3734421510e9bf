"""Sizing a job before it runs: a sample of the real input, its images read to their headers (never decoded),
planned and laid out as the job's workers do it, and its rows built with embeddings of the output's width and written
as the sink writes them. No tower runs, and no tensor is read: the checkpoint's vision tensors are checked against its
config.json from the safetensors headers alone (families.check_checkpoint), as the job checks them before it starts.

What it tells: tokens per image (p50, p90, max) under the run's resize settings, bytes per record and in all
(extrapolated from the plan's row counts), the data a unit writes and in how many files, the loader's memory per worker; given a rate of
images per second per device, the hours on a number of devices and the write bandwidth that needs.

Records are counted from the plan where its units know their rows (Parquet, `datasets`); a unit that only reading
counts (a JSON byte range, a tar shard) counts exactly where the sample read it whole, else from its bytes at the
input bytes per record the sample measured of units like it (Source.input_bytes: JSON records by their offsets, tar
members by their blocks); a stream that tells no size (dataset.kind=hub) leaves the count unknown.
"""

from __future__ import annotations

import hashlib
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from batchvlm.config import ConfigError, operational, positive
from batchvlm.executor.config import JobConfig
from batchvlm.executor.rows import Assembler
from batchvlm.executor.worker import checked_id, prepare, text_side_of
from batchvlm.families import check_checkpoint, load_family
from batchvlm.format.schema import DATA_SCHEMA, EMBED_DTYPES, QUARANTINE_SCHEMA, clip_column
from batchvlm.pipeline.decode import read_bytes, upright_size
from batchvlm.pipeline.encode import expected_rows
from batchvlm.pipeline.video import (Clip, DecodedVideo, Sampler, VideoConfig, display_rotation, probe,
                                     upright_frame_size)
from batchvlm.records import EncodedRecord, ImageRef, PreparedRecord, QuarantinedRecord, SourceRecord, WorkUnit
from batchvlm.rundir.layout import DATA
from batchvlm.rundir.patterns import PatternUnits
from batchvlm.review.status import readable_bytes
from batchvlm.rundir.sink import row_group_bytes
from batchvlm.sources import Source, make_source
from batchvlm.training.loader import resident_bytes


@dataclass
class EstimateConfig(JobConfig):
    """`batchvlm-estimate`: the embed job's config, and how to size it."""

    records: int = operational(1000)
    """Records sampled from the inputs, spread over the work units; their images' headers are read, not decoded."""
    images_per_s: float | None = operational(None)
    """Images per second one device embeds (measured with `batchvlm-bench task=e2e`, or a sample run): with it, the
    hours and the write bandwidth the job needs."""
    devices: int = operational(1)
    """Devices the job runs on (GPUs over every node)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        positive("records", self.records)
        positive("devices", self.devices)
        if self.images_per_s is not None:
            positive("images_per_s", self.images_per_s)


@dataclass(frozen=True)
class SizedImage:
    """An image known by its header: what a plan and a row need of it."""

    height: int
    width: int
    sha256: str
    format: str = ""


class HeaderReader:
    """Reads an image's (a clip's) bytes as the job does (confined, bounded) and its size from the header alone."""

    def __init__(self, cfg, video: VideoConfig | None = None):
        self.cfg, self.video = cfg, video or VideoConfig()

    def __call__(self, ref: ImageRef, image_index: int) -> SizedImage:
        data = read_bytes(ref, self.cfg, image_index)
        height, width = upright_size(data, self.cfg, image_index)
        return SizedImage(height, width, hashlib.sha256(data).hexdigest())

    def clip(self, ref: ImageRef, index: int, sample: Sampler) -> Clip:
        """The clip's header and the frames `sample` picks, none of them decoded: they stand in as one zero pixel
        seen at the header's size turned upright (the display rotation costs the clip's first frame decoded: PyAV
        gives it on frames only)."""
        data = read_bytes(ref, self.cfg, index, self.video.byte_limit)
        header = probe(data, self.video)
        indices = sample(header.frames, header.fps)
        rotation = display_rotation(data, header)
        shape = (len(indices), *upright_frame_size(header, rotation), 3)
        frames = np.broadcast_to(np.zeros((1, 1, 1, 3), np.uint8), shape)
        return Clip(header, DecodedVideo(frames, tuple(indices), tuple(header.timestamps_s[i] for i in indices),
                                         rotation))

    def close(self) -> None:
        """Nothing to stop: headers are read in this process."""


@dataclass(frozen=True)
class UnitSample:
    """What the sample read of one unit: how many records, the input bytes they take (None where the source cannot
    tell), and whether they are all of the unit's."""

    records: int
    input_bytes: int | None
    whole: bool


@dataclass(frozen=True)
class Estimate:
    family: str
    hidden_sizes: dict[str, int]
    embed_dtype: str
    records: int | None  # in the inputs (module docstring); None where a stream tells no size
    images_per_record: float
    sampled: int
    quarantined: int  # of the sample
    tokens_per_image: list[int]
    data_bytes_per_record: float
    quarantine_bytes_per_record: float
    file_bytes: int  # what each data file costs beyond its rows
    quarantine_file_bytes: int  # and each quarantine file
    units: int
    unit_records: float  # records per unit, on average
    shard_limit: int  # output.shard_bytes: a unit's rows of one kind are cut into files of at most this
    images_per_s: float | None
    devices: int
    checkpoint: str = ""  # what the header check of its vision tensors found
    clips_per_record: float = 0.0
    frames_per_clip: list[int] = field(default_factory=list)  # sampled, each clip of the sample, sorted
    decoded_per_clip: list[int] = field(default_factory=list)  # decoded: from the first through the last sampled
    tokens_per_clip: list[int] = field(default_factory=list)  # video tokens, sorted

    @property
    def written_fraction(self) -> float:
        return (self.sampled - self.quarantined) / self.sampled if self.sampled else 0.0

    @property
    def total_bytes(self) -> float | None:
        if self.records is None:
            return None
        written = self.records * self.written_fraction
        quarantine_files = self.quarantine_file_bytes if self.quarantined else 0
        return (written * self.data_bytes_per_record + (self.records - written) * self.quarantine_bytes_per_record
                + self.units * (self.file_bytes * self.files_per_unit + quarantine_files))

    @property
    def unit_bytes(self) -> float:
        """The data a unit writes."""
        return self.unit_records * self.written_fraction * self.data_bytes_per_record + self.file_bytes

    @property
    def files_per_unit(self) -> int:
        return max(1, math.ceil(self.unit_bytes / self.shard_limit))

    @property
    def loader_bytes(self) -> float:
        """The training loader's memory per worker: row groups of the data shards."""
        return resident_bytes(row_group_bytes(self.data_bytes_per_record, self.shard_limit))

    @property
    def seconds(self) -> float | None:
        """Hours of embedding at images_per_s; None without a rate or a record count, 0 where there is no image."""
        if self.images_per_s is None or self.records is None:
            return None
        return self.records * self.images_per_record / (self.images_per_s * self.devices)


def estimate(config: EstimateConfig) -> Estimate:
    family = load_family(config.model)
    hidden_sizes, checkpoint = check_checkpoint(family, EMBED_DTYPES[config.model.dtype])
    source = make_source(config.dataset, max_bytes=config.decode.max_bytes, clip_max_bytes=config.video.max_bytes)
    units = source.plan()
    if not units:
        raise ConfigError(f"dataset.path={config.dataset.path!r}: the inputs hold no rows")
    picked = units[::max(1, len(units) // config.records)]
    per_unit = math.ceil(config.records / len(picked))
    outcomes, samples = [], {}
    reader = HeaderReader(config.decode, config.video)
    text = text_side_of(family, config)
    for unit in picked:
        read, samples[unit.unit_id] = _sample(source, unit, per_unit)
        seen = set()
        outcomes += [checked_id(record, unit, seen) or prepare(record, family, config, reader, text)
                     for record in read]
    rows = Assembler(EMBED_DTYPES[config.output.embed_dtype], hidden_sizes, config.output.quarantine_bytes_cap,
                     "estimate").rows([_encoded(outcome, hidden_sizes) for outcome in outcomes])
    data = [row.values for row in rows if row.kind == DATA]
    quarantine = [row.values for row in rows if row.kind != DATA]
    prepared = [outcome for outcome in outcomes if isinstance(outcome, PreparedRecord)]
    empty = {schema: _parquet_bytes([], schema, config.output.compression)
             for schema in (DATA_SCHEMA, QUARANTINE_SCHEMA)}
    records = _records(units, samples)
    return Estimate(
        family=family.name, hidden_sizes=hidden_sizes, embed_dtype=config.output.embed_dtype,
        records=records, sampled=len(outcomes), quarantined=len(quarantine),
        images_per_record=sum(len(o.source.images) for o in outcomes) / max(1, len(outcomes)),
        tokens_per_image=sorted(plan.num_tokens for record in prepared for plan in record.plans),
        data_bytes_per_record=_per_row(data, DATA_SCHEMA, config.output.compression, empty[DATA_SCHEMA]),
        quarantine_bytes_per_record=_per_row(quarantine, QUARANTINE_SCHEMA, config.output.compression,
                                             empty[QUARANTINE_SCHEMA]),
        file_bytes=empty[DATA_SCHEMA], quarantine_file_bytes=empty[QUARANTINE_SCHEMA], units=len(units),
        unit_records=records / len(units) if records is not None else config.dataset.unit_records,
        shard_limit=config.output.shard_bytes, images_per_s=config.images_per_s, devices=config.devices,
        checkpoint=checkpoint, **clip_counts(outcomes, prepared))


def clip_counts(outcomes: list, prepared: list[PreparedRecord]) -> dict:
    """The sample's clips per record, and per clip its sampled frames, the frames decoding them takes (the decode runs
    in order from the first frame through the last sampled) and its video tokens, from headers and packets alone."""
    clips = [(clip, plan) for record in prepared for clip, plan in zip(record.clips, record.clip_plans)]
    return {"clips_per_record": sum(len(o.source.videos) for o in outcomes) / max(1, len(outcomes)),
            "frames_per_clip": sorted(len(clip.indices) for clip, _ in clips),
            "decoded_per_clip": sorted(max(clip.indices) + 1 for clip, _ in clips),
            "tokens_per_clip": sorted(plan.num_tokens for _, plan in clips)}


def _sample(source: Source, unit: WorkUnit, count: int) -> tuple[list[SourceRecord], UnitSample]:
    """The first `count` records of a unit, and what they tell of its size: the next record is read (not prepared)
    to tell whether they are all of it, and where they end."""
    read, rest = [], None
    for record in source.unit_records(unit):
        if len(read) == count:
            rest = record
            break
        read.append(record)
    return read, UnitSample(len(read), source.input_bytes(unit, read, rest), rest is None)


def _encoded(outcome: PreparedRecord | QuarantinedRecord, hidden_sizes: dict[str, int]):
    """A prepared record with embeddings of the output's width: what its row would hold, values aside."""
    if isinstance(outcome, QuarantinedRecord):
        return outcome
    embeds = {name: [torch.randn(expected_rows(name, plan), size) for plan in outcome.plans]
              for name, size in hidden_sizes.items()}
    clips = [torch.randn(plan.num_tokens, hidden_sizes["image_embeds"]) for plan in outcome.clip_plans]
    if clips:  # the clips' share of an output with a clip column (Qwen3-VL's deepstack, SigLIP2's pooled vectors)
        embeds |= {column: [torch.randn(expected_rows(name, plan), size) for plan in outcome.clip_plans]
                   for name, size in hidden_sizes.items() if (column := clip_column(name))}
    return EncodedRecord(outcome, embeds.pop("image_embeds"), embeds, video_embeds=clips)


def _parquet_bytes(rows: list[dict], schema: pa.Schema, compression: str) -> int:
    buffer = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), buffer,
                   compression=None if compression == "none" else compression)
    return buffer.tell()


def _per_row(rows: list[dict], schema: pa.Schema, compression: str, empty: int) -> float:
    """The bytes a row adds to a file of `schema` (`empty`: the file without rows)."""
    return max(0.0, (_parquet_bytes(rows, schema, compression) - empty) / len(rows)) if rows else 0.0


def _records(units: Sequence[WorkUnit], samples: dict[str, UnitSample]) -> int | None:
    """The records of the inputs: the plan's row counts, the sample's count of the units it read whole, and the rest
    from their bytes at the sample's input bytes per record; None where that is needed and the source tells no bytes.
    A pattern's units (none counted, each planned at its first file's size) are not gone through one by one."""
    whole = [sample for sample in samples.values() if sample.whole]
    if isinstance(units, PatternUnits):
        known, left, left_bytes = 0, len(units) - len(whole), (len(units) - len(whole)) * units[0].nbytes
    else:
        counted = {unit.unit_id for unit in units if unit.num_rows is not None}
        whole = [sample for unit_id, sample in samples.items() if sample.whole and unit_id not in counted]
        known = sum(unit.num_rows for unit in units if unit.num_rows is not None)
        rest = [unit for unit in units if unit.num_rows is None and not (unit.unit_id in samples and
                                                                           samples[unit.unit_id].whole)]
        left, left_bytes = len(rest), sum(unit.nbytes for unit in rest)
    if not left:
        return known + sum(sample.records for sample in whole)
    measured = [sample for sample in samples.values() if sample.input_bytes]
    if not measured:
        return None
    per_byte = sum(sample.records for sample in measured) / sum(sample.input_bytes for sample in measured)
    return known + sum(sample.records for sample in whole) + round(left_bytes * per_byte)


def quantile(values: list, q: float):
    """The `q` quantile of sorted `values` (nearest rank below)."""
    return values[min(len(values) - 1, int(q * len(values)))]


def clips_line(result: Estimate) -> str:
    spread = lambda values: "/".join(str(quantile(values, q)) for q in (0.5, 0.9, 1))  # noqa: E731
    return (f"clips: {result.clips_per_record:.2f} per record; per clip (p50/p90/max): sampled frames "
            f"{spread(result.frames_per_clip)}, decoded (first through last sampled) {spread(result.decoded_per_clip)}, "
            f"video tokens {spread(result.tokens_per_clip)}")


def format_estimate(result: Estimate) -> str:
    tokens = result.tokens_per_image
    records = (f"records: {result.records:,} in {result.units:,} units; output in all: "
               f"{readable_bytes(result.total_bytes)}" if result.records is not None else
               f"records: not known before they are read (the inputs stream without sizes), in {result.units:,} units")
    lines = [f"estimate: {result.family}, output width {result.hidden_sizes['image_embeds']} in {result.embed_dtype}"
             + "".join(f", {name} {size}" for name, size in result.hidden_sizes.items() if name != "image_embeds"),
             f"checkpoint: {result.checkpoint}",
             f"sample: {result.sampled} records ({result.quarantined} would be quarantined), "
             f"{result.images_per_record:.2f} images per record",
             f"tokens per image: p50 {quantile(tokens, 0.5)}  p90 {quantile(tokens, 0.9)}  max {tokens[-1]}" if tokens
             else "tokens per image: no image in the sample",
             *([clips_line(result)] if result.tokens_per_clip else []),
             f"bytes per record: {readable_bytes(result.data_bytes_per_record)} written"
             + (f", {readable_bytes(result.quarantine_bytes_per_record)} quarantined" if result.quarantined else ""),
             records,
             f"data per unit ({result.unit_records:,.0f} records on average): {readable_bytes(result.unit_bytes)} in "
             f"{result.files_per_unit} file(s) of at most {readable_bytes(result.shard_limit)}; loader memory per "
             f"worker: {readable_bytes(result.loader_bytes)}"]
    seconds = result.seconds
    if seconds == 0:
        lines.append("time: no image to embed in the sample; the job's time is reading, tokenizing and writing")
    elif seconds is not None:
        lines.append(f"at {result.images_per_s:g} images/s per device on {result.devices} devices: "
                     f"{seconds / 3600:.1f} h, writing {readable_bytes(result.total_bytes / seconds)}/s")
    elif result.records is None:
        lines.append("time: not known without a record count")
    else:
        lines.append("time: give images_per_s=<per device> (batchvlm-bench task=e2e measures it) and devices=<n>")
    return "\n".join(lines)
