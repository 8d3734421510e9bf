"""Sources: a job's inputs, cut into work units from metadata alone, and read back a unit at a time.

One module per kind of input (datatrove's readers/): `parquet` (pyarrow, a row group at a time,
never copied), `webdataset` (tar shards streamed member by member), `hf` (Hugging Face `datasets`:
save_to_disk folders, imagefolders, streamed hub datasets). Every input path may be an fsspec URL
(`s3://`, `gs://`, `hf://`, `file://`); `dataset.storage_options` reach the file system.

Rank 0 lists the inputs and plans the units (`plan`), which costs O(files): Parquet footers, tar
sizes, dataset shard counts; no image byte is read before work starts. Every rank then reads the
units it claims through `records(unit)`, from the inputs the plan names (`from_plan`).

What the kinds share: `files` (listing and opening inputs), `columns` (the types the configured columns must have),
`rows` (units cut from row groups, a row read as a record); each kind's config is in `config`.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator

from batchvlm.records import InputFile, SourceRecord, WorkUnit
from batchvlm.sources.config import DatasetConfig

KINDS = {"demo": "parquet", "parquet": "parquet", "webdataset": "webdataset", "json": "jsonl", "disk": "hf",
         "imagefolder": "hf", "hub": "hf"}
"""dataset.kind -> the module under batchvlm/sources/ that reads it."""


class Source:
    """A kind of input: list the inputs, plan their units from metadata, read a unit's records."""

    def __init__(self, cfg: DatasetConfig, inputs: list[InputFile] | None = None, max_bytes: int | None = None):
        self.cfg = cfg
        self.max_bytes = max_bytes  # decode.max_bytes: what a stream source does not read into memory at all
        self.inputs = {item.name: item for item in (inputs if inputs is not None else self.list_inputs())}

    def list_inputs(self) -> list[InputFile]:
        raise NotImplementedError

    def plan(self) -> list[WorkUnit]:
        raise NotImplementedError

    def records(self, unit: WorkUnit) -> Iterator[SourceRecord]:
        """The unit's records in input order, each with `seq` (its position in the unit) set."""
        raise NotImplementedError

    def records_at(self, name: str, rows: list[int]) -> Iterator[SourceRecord]:
        """Chosen rows (sorted) of one input, for a requeue; stream sources scan to them."""
        raise NotImplementedError

    def all_ids(self, name: str) -> Iterator[tuple[int, str | None]]:
        """(row, id) of every row of an input: what a requeue scans when a record moved."""
        raise NotImplementedError


def make_source(cfg: DatasetConfig, inputs: list[InputFile] | None = None, max_bytes: int | None = None) -> Source:
    """The source of `dataset.kind`; with `inputs` (a plan's), nothing is listed again."""
    module = importlib.import_module(f"batchvlm.sources.{KINDS[cfg.kind]}")
    return module.SOURCE(cfg, inputs, max_bytes)
