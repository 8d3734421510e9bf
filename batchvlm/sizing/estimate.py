"""Sizing a job before it runs: a sample of the real input, its images read to their headers (never decoded),
planned and laid out as the job's workers do it, and its rows built with embeddings of the output's width and written
as the sink writes them. No tower runs.

What it tells: tokens per image (p50, p90, max) under the run's resize settings, bytes per record and in all
(extrapolated from the plan's row counts), the data a unit writes and in how many files, the loader's memory per worker; given a rate of
images per second per device, the hours on a number of devices and the write bandwidth that needs.
"""

from __future__ import annotations

import hashlib
import io
import math
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from batchvlm.config import operational, positive
from batchvlm.executor.config import JobConfig
from batchvlm.executor.rows import Assembler
from batchvlm.executor.worker import checked_id, prepare, text_side_of
from batchvlm.families import load_family
from batchvlm.format.schema import DATA_SCHEMA, EMBED_DTYPES, QUARANTINE_SCHEMA
from batchvlm.pipeline.decode import read_bytes, upright_size
from batchvlm.pipeline.encode import expected_rows
from batchvlm.records import EncodedRecord, ImageRef, PreparedRecord, QuarantinedRecord, WorkUnit
from batchvlm.rundir.layout import DATA
from batchvlm.review.status import readable_bytes
from batchvlm.rundir.sink import row_group_bytes
from batchvlm.sources import make_source
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


TAR_BLOCK = 512


@dataclass(frozen=True)
class SizedImage:
    """An image known by its header: what a plan and a row need of it."""

    height: int
    width: int
    sha256: str
    format: str = ""


class HeaderReader:
    """Reads an image's bytes as the job does (confined, bounded) and its size from the header alone."""

    def __init__(self, cfg):
        self.cfg = cfg

    def __call__(self, ref: ImageRef, image_index: int) -> SizedImage:
        data = read_bytes(ref, self.cfg, image_index)
        height, width = upright_size(data, self.cfg, image_index)
        return SizedImage(height, width, hashlib.sha256(data).hexdigest())

    def close(self) -> None:
        """Nothing to stop: headers are read in this process."""


@dataclass(frozen=True)
class Estimate:
    family: str
    hidden_sizes: dict[str, int]
    embed_dtype: str
    records: int  # in the inputs: the plan's row counts (and, for units that do not know theirs, their bytes)
    images_per_record: float
    sampled: int
    quarantined: int  # of the sample
    tokens_per_image: list[int]
    data_bytes_per_record: float
    quarantine_bytes_per_record: float
    file_bytes: int  # what each shard file costs beyond its rows
    units: int
    unit_records: int
    shard_limit: int  # output.shard_bytes: a unit's rows of one kind are cut into files of at most this
    images_per_s: float | None
    devices: int

    @property
    def written_fraction(self) -> float:
        return (self.sampled - self.quarantined) / self.sampled if self.sampled else 0.0

    @property
    def total_bytes(self) -> float:
        written = self.records * self.written_fraction
        return (written * self.data_bytes_per_record + (self.records - written) * self.quarantine_bytes_per_record
                + self.units * self.file_bytes * (self.files_per_unit + (self.quarantined > 0)))

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
        if self.images_per_s is None:
            return None
        return self.records * self.images_per_record / (self.images_per_s * self.devices)


def estimate(config: EstimateConfig) -> Estimate:
    family = load_family(config.model)
    hidden_sizes = family.load_encoder(torch.device("cpu"), EMBED_DTYPES[config.model.dtype]).hidden_sizes
    source = make_source(config.dataset, max_bytes=config.decode.max_bytes)
    units = source.plan()
    picked = units[::max(1, len(units) // config.records)]
    per_unit = math.ceil(config.records / len(picked))
    outcomes, record_bytes = [], []
    reader = HeaderReader(config.decode)
    text = text_side_of(family, config)
    for unit in picked:
        seen = set()
        for index, record in enumerate(source.records(unit)):
            if index == per_unit:
                break
            outcomes.append(checked_id(record, unit, seen) or prepare(record, family, config, reader, text))
            record_bytes.append(_tar_bytes(record))
    rows = Assembler(EMBED_DTYPES[config.output.embed_dtype], hidden_sizes, config.output.quarantine_bytes_cap,
                     "estimate").rows([_encoded(outcome, hidden_sizes) for outcome in outcomes])
    data = [row.values for row in rows if row.kind == DATA]
    quarantine = [row.values for row in rows if row.kind != DATA]
    prepared = [outcome for outcome in outcomes if isinstance(outcome, PreparedRecord)]
    empty = _parquet_bytes([], DATA_SCHEMA, config.output.compression)
    return Estimate(
        family=family.name, hidden_sizes=hidden_sizes, embed_dtype=config.output.embed_dtype,
        records=_records(units, record_bytes), sampled=len(outcomes), quarantined=len(quarantine),
        images_per_record=sum(len(o.source.images) for o in outcomes) / max(1, len(outcomes)),
        tokens_per_image=sorted(plan.num_tokens for record in prepared for plan in record.plans),
        data_bytes_per_record=_per_row(data, DATA_SCHEMA, config.output.compression, empty),
        quarantine_bytes_per_record=_per_row(quarantine, QUARANTINE_SCHEMA, config.output.compression, empty),
        file_bytes=empty, units=len(units), unit_records=config.dataset.unit_records,
        shard_limit=config.output.shard_bytes,
        images_per_s=config.images_per_s, devices=config.devices)


def _encoded(outcome: PreparedRecord | QuarantinedRecord, hidden_sizes: dict[str, int]):
    """A prepared record with embeddings of the output's width: what its row would hold, values aside."""
    if isinstance(outcome, QuarantinedRecord):
        return outcome
    embeds = {name: [torch.randn(expected_rows(name, plan), size) for plan in outcome.plans]
              for name, size in hidden_sizes.items()}
    return EncodedRecord(outcome, embeds.pop("image_embeds"), embeds)


def _parquet_bytes(rows: list[dict], schema: pa.Schema, compression: str) -> int:
    buffer = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), buffer,
                   compression=None if compression == "none" else compression)
    return buffer.tell()


def _per_row(rows: list[dict], schema: pa.Schema, compression: str, empty: int) -> float:
    return (_parquet_bytes(rows, schema, compression) - empty) / len(rows) if rows else 0.0


def _tar_bytes(record) -> int:
    """What a record takes in a tar shard (its image and text members, each a header and whole blocks): how units
    that do not know their row count are counted."""
    sizes = [len(ref.data) if ref.data is not None else ref.size or 0 for ref in record.images] + [len(record.text)]
    return sum(TAR_BLOCK + math.ceil(size / TAR_BLOCK) * TAR_BLOCK for size in sizes)


def _records(units: list[WorkUnit], record_bytes: list[int]) -> int:
    known = sum(unit.num_rows for unit in units if unit.num_rows is not None)
    unknown_bytes = sum(unit.nbytes for unit in units if unit.num_rows is None)
    return known + (round(unknown_bytes / np.mean(record_bytes)) if unknown_bytes and record_bytes else 0)


def format_estimate(result: Estimate) -> str:
    tokens = result.tokens_per_image
    quantile = (lambda q: tokens[min(len(tokens) - 1, int(q * len(tokens)))]) if tokens else (lambda q: 0)
    lines = [f"estimate: {result.family}, output width {result.hidden_sizes['image_embeds']} in {result.embed_dtype}"
             + "".join(f", {name} {size}" for name, size in result.hidden_sizes.items() if name != "image_embeds"),
             f"sample: {result.sampled} records ({result.quarantined} would be quarantined), "
             f"{result.images_per_record:.2f} images per record",
             f"tokens per image: p50 {quantile(0.5)}  p90 {quantile(0.9)}  max {max(tokens, default=0)}",
             f"bytes per record: {readable_bytes(result.data_bytes_per_record)} written"
             + (f", {readable_bytes(result.quarantine_bytes_per_record)} quarantined" if result.quarantined else ""),
             f"records: {result.records:,} in {result.units:,} units; output in all: "
             f"{readable_bytes(result.total_bytes)}",
             f"data per unit ({result.unit_records:,} records): {readable_bytes(result.unit_bytes)} in "
             f"{result.files_per_unit} file(s) of at most {readable_bytes(result.shard_limit)}; loader memory per "
             f"worker: {readable_bytes(result.loader_bytes)}"]
    if (seconds := result.seconds) is not None:
        lines.append(f"at {result.images_per_s:g} images/s per device on {result.devices} devices: "
                     f"{seconds / 3600:.1f} h, writing {readable_bytes(result.total_bytes / seconds)}/s")
    else:
        lines.append("time: give images_per_s=<per device> (batchvlm-bench task=e2e measures it) and devices=<n>")
    return "\n".join(lines)
