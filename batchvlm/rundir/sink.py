"""Sink: Parquet shards streamed to disk per work unit and committed atomically, ids files, manifests.

Rows of an open unit go to temporary Parquet files a row group at a time (memory is a row group,
not a unit), in the unit's input order (a short reorder buffer absorbs the batching). A unit commits
once every record is a row or a quarantine row, if this rank still holds its claim: each file is
fsynced and renamed to a name carrying the claim's token (two holders of one unit never write the
same file), then the manifest is published exclusively and is the commit. A unit with no quarantined
record writes no quarantine file. Readers and resume trust only what a manifest lists.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import ClassVar

import pyarrow as pa
import pyarrow.parquet as pq

from batchvlm.config import Choice, Config, ConfigError, operational, positive, written
from batchvlm.faults import crash_point
from batchvlm.format.schema import DATA_SHARD, QUARANTINE_SHARD, Dtype, Shard
from batchvlm.pipeline.preprocess import merged_stats
from batchvlm.records import OutputRow, UnitEnd, UnitStart, WorkUnit
from batchvlm.rundir.claims import Claim, Claims
from batchvlm.rundir.dedup import write_ids
from batchvlm.rundir.durable import json_text, publish, publish_exclusive, sha256_file, temporary_name
from batchvlm.rundir.layout import DATA, IDS, QUARANTINE, RunLayout
from batchvlm.rundir.manifest import Listing, Manifest
from batchvlm.rundir.rank_reports import RankUnits


class Compression(Choice):
    zstd = "zstd"
    snappy = "snappy"
    none = "none"


@dataclass
class OutputConfig(Config):
    KEY: ClassVar[str] = "output"

    root: str = operational("outputs")
    """Folder that holds run directories."""
    embed_dtype: Dtype = written(Dtype.bfloat16)
    """dtype of stored embeddings (raw little-endian bytes): bfloat16 | float16 | float32."""
    compression: Compression = operational(Compression.zstd)
    """Of the Parquet files: zstd | snappy | none (the rows are the same)."""
    quarantine_bytes_cap: int = written(4 * 1024 * 1024)
    """Original image bytes kept in a quarantine row up to this size; larger ones keep only their path."""
    shard_bytes: int = operational(1024 * 1024 * 1024)
    """Bytes of a data or quarantine file at most, its footer included: a unit writes as many files as its rows need,
    all listed in its manifest, each a few row groups (of a quarter of this, 64 MB at most). A single record larger
    than that gets a file of its own."""

    def __post_init__(self) -> None:
        super().__post_init__()
        positive("output.shard_bytes", self.shard_bytes)
        if self.quarantine_bytes_cap < 0:
            raise ConfigError("output.quarantine_bytes_cap must be >= 0")


log = logging.getLogger("batchvlm")

SHARDS = {DATA: DATA_SHARD, QUARANTINE: QUARANTINE_SHARD}
ROW_GROUP_ROWS = 256
ROW_GROUP_BYTES = 64 * 1024 * 1024
DEFAULT_SHARD_BYTES = OutputConfig.shard_bytes


def group_byte_limit(shard_bytes: int) -> int:
    """Where a row group is cut short of ROW_GROUP_ROWS: a few row groups a file."""
    return min(ROW_GROUP_BYTES, shard_bytes // 4)


def row_group_bytes(record_bytes: float, shard_bytes: int) -> float:
    """About what a row group of records of this size holds (a record alone when it is larger than the limit)."""
    return max(record_bytes, min(ROW_GROUP_ROWS * record_bytes, group_byte_limit(shard_bytes)))


FOOTER_BYTES_PER_GROUP = 4096
"""What a row group adds to a Parquet footer at most, reserved before it is written (about 90 bytes a column)."""


class ShardWriter:
    """One kind of a unit's rows, written a row group at a time to temporary files of at most `shard_bytes` each,
    footer included (a row group larger than that alone gets a file of its own); the first opened on the first row.
    `path_of(n)` names the n-th file; every row is checked against the contract's declaration of `shard` first."""

    def __init__(self, path_of: Callable[[int], Path], shard: Shard, metadata: dict, compression: str | None,
                 shard_bytes: int):
        self.path_of, self.shard, self.metadata, self.compression = path_of, shard, metadata, compression
        self.schema = shard.schema
        self.shard_bytes = shard_bytes
        self.group_bytes = group_byte_limit(shard_bytes)
        # the footer holds the schema twice (Parquet's, and Arrow's serialized), then each row group's columns
        self.footer_bytes = 2 * self.schema.with_metadata(metadata).serialize().size
        self.parts: list[ShardPart] = []
        self.writer: pq.ParquetWriter | None = None
        self.file: pa.NativeFile | None = None
        self.buffer: list[dict] = []
        self.buffered_bytes = 0
        self.rows = 0

    def append(self, row: dict) -> None:
        self.shard.check_row(row)
        self.buffer.append(row)
        self.buffered_bytes += sum(len(v) for v in row.values() if isinstance(v, (bytes, str)))
        self.rows += 1
        if len(self.buffer) >= ROW_GROUP_ROWS or self.buffered_bytes >= self.group_bytes:
            self._flush()

    def _flush(self) -> None:
        if not self.buffer:
            return
        table = pa.Table.from_pylist(self.buffer, schema=self.schema.with_metadata(self.metadata))
        if self.writer is not None and not self._fits(table):
            self._close_part()
        if self.writer is None:
            self._open_part()
        self.writer.write_table(table)
        self.parts[-1].rows += len(self.buffer)
        self.parts[-1].groups += 1
        self.buffer, self.buffered_bytes = [], 0

    def _fits(self, table: pa.Table) -> bool:
        """The open file with this row group and its footer stays within shard_bytes (the row group's Arrow size
        bounds what compressed Parquet writes of it)."""
        footer = self.footer_bytes + (self.parts[-1].groups + 1) * FOOTER_BYTES_PER_GROUP
        return self.file.tell() + table.nbytes + footer <= self.shard_bytes

    def _open_part(self) -> None:
        part = ShardPart(self.path_of(len(self.parts)))
        self.parts.append(part)
        self.file = pa.OSFile(str(part.tmp), "wb")
        self.writer = pq.ParquetWriter(self.file, self.schema.with_metadata(self.metadata),
                                       compression=self.compression or "none")

    def _close_part(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.file.close()
        self.writer = self.file = None

    def finish(self) -> list[ShardPart]:
        """The files, complete (still under their temporary names)."""
        self._flush()
        self._close_part()
        return self.parts

    def discard(self) -> None:
        self._close_part()
        for part in self.parts:
            part.tmp.unlink(missing_ok=True)


@dataclass
class ShardPart:
    """One file of a shard: its final name, the temporary one it is written under, its rows."""

    path: Path
    rows: int = 0
    groups: int = 0

    @property
    def tmp(self) -> Path:
        return temporary_name(self.path)


@dataclass
class OpenUnit:
    unit: WorkUnit
    claim: Claim
    shards: dict[str, ShardWriter]
    pending: dict[int, OutputRow] = field(default_factory=dict)  # by seq, until the rows before it arrive
    next_seq: int = 0
    ids: list[tuple[str, int, str]] = field(default_factory=list)
    checks: Counter = field(default_factory=Counter)
    preprocess: list = field(default_factory=list)  # each record's PreprocessStats.counts()
    expected: int | None = None

    @property
    def complete(self) -> bool:
        return self.expected is not None and self.next_seq == self.expected and not self.pending


class RunSink:
    """Writes one rank's units into the run directory's unit folders and commits them under their claims."""

    def __init__(self, layout: RunLayout, metadata: dict[str, str], compression: str, claims: Claims,
                 dedup_buckets: int, rank: int = 0, shard_bytes: int = DEFAULT_SHARD_BYTES,
                 units: RankUnits | None = None):
        self.layout = layout
        self.shard_bytes = shard_bytes
        self.rank = rank
        self.claims = claims
        self.dedup_buckets = dedup_buckets
        self.metadata = {k.encode(): v.encode() for k, v in metadata.items()}
        self.compression = None if compression == "none" else compression
        for folder in layout.unit_folders():
            folder.mkdir(parents=True, exist_ok=True)
        self.open: dict[str, OpenUnit] = {}
        self.lost: list[str] = []  # units another rank committed or took over first
        self.units = units or RankUnits()  # what the rank reports of its commits (rundir.rank_reports)

    # -- records --------------------------------------------------------------------------------
    def start_unit(self, unit: WorkUnit, claim: Claim) -> None:
        shards = {kind: ShardWriter(partial(self.layout.shard, kind, unit.unit_id, claim.token), shard, self.metadata,
                                    self.compression, self.shard_bytes) for kind, shard in SHARDS.items()}
        self.open[unit.unit_id] = OpenUnit(unit, claim, shards)

    def add(self, row: OutputRow) -> None:
        """A record's row, written once every row before it in the unit is."""
        unit_id = row.source.unit_id
        state = self.open[unit_id]
        state.pending[row.source.seq] = row
        while state.next_seq in state.pending:
            row = state.pending.pop(state.next_seq)
            state.shards[row.kind].append(row.values)
            state.ids.append((row.values["id"], row.values["row"], row.kind))
            if row.kind == QUARANTINE:
                state.checks[row.values["check"]] += 1
            state.preprocess.append(row.preprocess)
            state.next_seq += 1
        self._maybe_commit(unit_id)

    def end_unit(self, unit: WorkUnit, num_records: int) -> None:
        self.open[unit.unit_id].expected = num_records
        self._maybe_commit(unit.unit_id)

    def _maybe_commit(self, unit_id: str) -> None:
        if self.open[unit_id].complete:
            self.commit(self.open.pop(unit_id))

    def commit(self, state: OpenUnit) -> Manifest | None:
        """Publish the unit's files and its manifest; None where another holder won the unit."""
        unit = state.unit
        if not self.claims.holds(state.claim):
            return self._give_up(state, "another rank took the unit over")
        try:
            files = self._publish_files(state)
        except FileNotFoundError:  # a holder that outlived its lease: the run's end cleared its files
            return self._give_up(state, "its files were removed after another rank committed the unit")
        crash_point("commit.before_manifest")
        manifest = Manifest(unit=unit.unit_id, source=unit.source, start=unit.start, stop=unit.stop,
                            records_in=state.expected, written=state.shards[DATA].rows,
                            quarantined=state.shards[QUARANTINE].rows, checks=dict(sorted(state.checks.items())),
                            files=files, rank=self.rank, claim=state.claim.token, **merged_stats(state.preprocess))
        path = self.layout.manifest(unit.unit_id)
        tmp = temporary_name(self.layout.manifest_draft(unit.unit_id, state.claim.token))
        tmp.write_text(json_text(manifest.to_json()))
        if not publish_exclusive(tmp, path):
            for listing in manifest.listings():
                self.layout.listed(listing.path).unlink(missing_ok=True)
            self._lose(unit.unit_id)
            log.info("unit %s was committed by another rank first; this rank's copy is removed", unit.unit_id)
            return None
        self.units.commit(manifest)
        return manifest

    def _publish_files(self, state: OpenUnit) -> dict[str, Listing]:
        """Shards with rows, then the ids file, each renamed to its final name; their manifest listings."""
        files = {}
        for kind, shard in state.shards.items():
            for part in shard.finish():
                publish(part.tmp, part.path)
                files.setdefault(kind, []).append(self._listing(part.path, part.rows))
        ids_path = self.layout.shard(IDS, state.unit.unit_id, state.claim.token)
        ids_tmp = temporary_name(ids_path)
        buckets = write_ids(ids_tmp, state.ids, self.dedup_buckets)
        publish(ids_tmp, ids_path)
        files[IDS] = [self._listing(ids_path, len(state.ids), buckets)]
        return files

    def _give_up(self, state: OpenUnit, why: str) -> None:
        for shard in state.shards.values():
            shard.discard()
        self._lose(state.unit.unit_id)
        log.warning("unit %s not committed: %s", state.unit.unit_id, why)
        return None

    def _lose(self, unit_id: str) -> None:
        self.lost.append(unit_id)
        self.units.lose(unit_id)

    def _listing(self, path: Path, rows: int, buckets: dict[str, int] | None = None) -> Listing:
        return Listing(self.layout.name_of(path), rows, path.stat().st_size, sha256_file(path), buckets)

    def abandon_open_units(self) -> None:
        """Units left open when the stream ended early (a job abort): their temporary files go."""
        for state in self.open.values():
            for shard in state.shards.values():
                shard.discard()
        self.open.clear()


class SinkWriter:
    """Runs the sink on a thread behind a bounded queue, so writing never stalls the device loop: `start_unit`, `add`
    and `end_unit` hand it the job's stream in order, as the sink's own methods of those names take it."""

    def __init__(self, sink: RunSink, maxsize: int):
        self.sink = sink
        self.queue: queue.Queue = queue.Queue(maxsize=maxsize)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="batchvlm-sink", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (call := self.queue.get()) is not None:
            if self.error is None:
                try:
                    call()
                except BaseException as error:  # surfaced to the main thread on the next call or close
                    self.error = error

    def start_unit(self, start: UnitStart) -> None:
        self._submit(partial(self.sink.start_unit, start.unit, start.claim))

    def add(self, row: OutputRow) -> None:
        self._submit(partial(self.sink.add, row))

    def end_unit(self, end: UnitEnd) -> None:
        self._submit(partial(self.sink.end_unit, end.unit, end.num_records))

    def _submit(self, call: Callable[[], None]) -> None:
        self._raise_if_failed()
        self.queue.put(call)

    def close(self) -> None:
        if self.thread.is_alive():
            self.queue.put(None)
            self.thread.join()
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"the sink failed: {self.error}") from self.error
