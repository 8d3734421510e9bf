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
from collections.abc import Iterator, Sequence

from batchvlm.checks import failure
from batchvlm.records import InputFile, SourceRecord, WorkUnit
from batchvlm.rundir.patterns import PatternInputs, PatternUnits
from batchvlm.sources.config import DatasetConfig

KINDS = {"demo": "parquet", "parquet": "parquet", "webdataset": "webdataset", "json": "jsonl", "disk": "hf",
         "imagefolder": "hf", "hub": "hf"}
"""dataset.kind -> the module under batchvlm/sources/ that reads it."""


class Source:
    """A kind of input: list the inputs, plan their units from metadata, read a unit's records."""

    rows_are_offsets = False
    """A record's row is the byte offset where it starts (JSON), not its number in its input."""

    def __init__(self, cfg: DatasetConfig, inputs: Sequence[InputFile] | None = None, max_bytes: int | None = None,
                 clip_max_bytes: int | None = None):
        self.cfg = cfg
        self.max_bytes = max_bytes  # decode.max_bytes: what a stream source does not read into memory at all
        self.clip_max_bytes = clip_max_bytes  # video.max_bytes: the same for a clip
        inputs = self.list_inputs() if inputs is None else inputs
        # a pattern too large to list is looked up name by name, never held
        self.pattern = inputs if isinstance(inputs, PatternInputs) else None
        self.inputs = inputs.by_name if self.pattern is not None else {item.name: item for item in inputs}

    def list_inputs(self) -> Sequence[InputFile]:
        raise NotImplementedError

    def pattern_units(self) -> PatternUnits | None:
        """The units of inputs named by a pattern too large to list: one per file, from the pattern alone."""
        return None if self.pattern is None else PatternUnits(self.pattern)

    def plan(self) -> list[WorkUnit]:
        raise NotImplementedError

    def records(self, unit: WorkUnit) -> Iterator[SourceRecord]:
        """The unit's records in input order, each with `seq` (its position in the unit) set."""
        raise NotImplementedError

    def unit_records(self, unit: WorkUnit) -> Iterator[SourceRecord]:
        """records(unit); a file a pattern too large to list named that is not there when its unit is read ends the
        unit's records with one that fails source.missing_input (its unit commits, the job goes on)."""
        seq = 0
        try:
            for seq, record in enumerate(self.records(unit), 1):
                yield record
        except FileNotFoundError as error:
            if self.pattern is None:
                raise  # a listed input that went away: the plan no longer holds
            record = SourceRecord(f"{unit.source}#missing", unit.unit_id, self.inputs[unit.source].location, 0, "",
                                  [], seq)
            record.failure = failure("source.missing_input", f"{record.source} does not exist ({error})",
                                     expected="a file the pattern names", observed="no such file")
            yield record

    def records_at(self, name: str, rows: list[int]) -> Iterator[SourceRecord]:
        """Chosen rows (sorted) of one input, for a requeue; stream sources scan to them."""
        raise NotImplementedError

    def all_ids(self, name: str) -> Iterator[tuple[int, str | None]]:
        """(row, id) of every row of an input: what a requeue scans when a record moved."""
        raise NotImplementedError

    def input_bytes(self, unit: WorkUnit, first: list[SourceRecord], rest: SourceRecord | None) -> int | None:
        """The bytes of the unit's input that its `first` records take (`rest`: the record after them, None where they
        are all of it): how the estimate counts the records of units whose count only reading tells. None where the
        source cannot tell (its units know their rows)."""
        return None


def source_class(kind: str) -> type[Source]:
    """The Source that reads inputs of `dataset.kind`."""
    return importlib.import_module(f"batchvlm.sources.{KINDS[kind]}").SOURCE


def make_source(cfg: DatasetConfig, inputs: list[InputFile] | None = None, max_bytes: int | None = None,
                clip_max_bytes: int | None = None) -> Source:
    """The source of `dataset.kind`; with `inputs` (a plan's), nothing is listed again."""
    return source_class(cfg.kind)(cfg, inputs, max_bytes, clip_max_bytes)
