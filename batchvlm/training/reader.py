"""Reading the output back: a shard row -> tensors, without copying the embedding bytes."""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from batchvlm.config import differences
from batchvlm.format.hf_features import SIZE_KEY
from batchvlm.format.schema import EMBED_DTYPES, EXTRA_OUTPUTS, TENSOR_COLUMNS, check_format, format_of
from batchvlm.rundir.dedup import excluded_rows
from batchvlm.rundir.durable import read_json
from batchvlm.rundir.layout import DATA, RunLayout
from batchvlm.rundir.manifest import checked_shards
from batchvlm.rundir.upgrade import check_run_format


@dataclass
class RecordTensors:
    id: str
    input_ids: torch.Tensor  # [seq] int64
    image_embeds: torch.Tensor  # [n_tokens, hidden], the stored dtype
    grid_thw: torch.Tensor  # [n_images, 3] int64
    image_spans: torch.Tensor  # [n_images, 2] int64: (start, length)
    token_tags: torch.Tensor  # [seq] int8
    extras: dict[str, torch.Tensor]  # tower_embeds / deepstack_embeds [n_tokens, h], pooled_embeds [n_images, h]
    position_ids: torch.Tensor | None  # [3, seq] int64 M-RoPE positions (Qwen), else None
    rope_delta: int | None
    loss_mask: torch.Tensor | None = None  # [seq] int8, 1 where trained: a conversation's; None for a plain text
    video_embeds: torch.Tensor | None = None  # [n_video_tokens, hidden]: a record with clips (qwen2_vl)
    video_spans: torch.Tensor | None = None  # [n_clips, 2] int64: (start, length)
    video_grid_thw: torch.Tensor | None = None  # [n_clips, 3] int64: each clip's (t, h, w) in patches
    second_per_grid_ts: torch.Tensor | None = None  # [n_clips] float64: seconds one temporal patch spans

    def image_token_positions(self) -> torch.Tensor:
        """Sequence positions of the image tokens, in the order of the rows of image_embeds."""
        spans = self.image_spans.numpy(force=True)
        return torch.from_numpy(span_positions(spans[:, 0], spans[:, 1]))


def span_positions(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """start, start+1, ..., start+length-1 for every span, in span order, in one pass over all spans."""
    before = np.cumsum(lengths) - lengths  # the output index each span begins at
    return np.arange(int(lengths.sum()), dtype=np.int64) + np.repeat(starts - before, lengths)


def embedding_layout(schema: pa.Schema) -> tuple[torch.dtype, int]:
    meta = schema.metadata or {}
    return EMBED_DTYPES[meta[b"batchvlm.embed_dtype"].decode()], int(meta[b"batchvlm.hidden_size"])


def _hidden_size(schema: pa.Schema, name: str) -> int | None:
    value = (schema.metadata or {}).get(f"{SIZE_KEY}{name}".encode())
    return int(value) if value is not None else None


# Embeddings cross numpy as their bits (numpy has no bfloat16): they are only sliced and concatenated there.
_BITS = {2: np.int16, 4: np.int32}
_BITS_TORCH = {2: torch.int16, 4: torch.int32}


def _as_bits(values: torch.Tensor) -> np.ndarray:
    return values.view(_BITS_TORCH[values.element_size()]).numpy(force=True)


def tensor_of(values: np.ndarray, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A numpy array as a tensor sharing its memory (read-only Arrow memory too), its bits viewed as `dtype`."""
    with warnings.catch_warnings():
        # Arrow buffers are read-only; tensors that view them rather than copy them are the point.
        warnings.simplefilter("ignore", UserWarning)
        tensor = torch.from_numpy(values)
    return tensor.view(dtype) if dtype is not None else tensor


@dataclass
class RecordArrays:
    """One record as numpy views on its shard's columns: what packing reads. A numpy slice costs a fraction of a
    tensor view's dispatch, and a loader takes thousands of records a second."""
    id: str
    input_ids: np.ndarray  # [seq], as stored (int32)
    token_tags: np.ndarray  # [seq] int8
    image_spans: np.ndarray  # [n_images, 2]: (start, length)
    grid_thw: np.ndarray  # [n_images, 3]
    position_ids: np.ndarray | None  # [3, seq], or None
    embeds: dict[str, np.ndarray]  # image_embeds and the extras present: [rows, hidden], their bits (_BITS)
    embed_dtype: torch.dtype
    rope_delta: int | None
    loss_mask: np.ndarray | None = None  # [seq] int8, or None
    video_spans: np.ndarray | None = None  # [n_clips, 2]: (start, length); its rows in embeds["video_embeds"]
    video_grid_thw: np.ndarray | None = None  # [n_clips, 3]
    second_per_grid_ts: np.ndarray | None = None  # [n_clips]

    def tensors(self) -> RecordTensors:
        embeds = {name: tensor_of(rows, self.embed_dtype) for name, rows in self.embeds.items()}
        return RecordTensors(
            id=self.id, input_ids=_tensor(self.input_ids, np.int64), token_tags=_tensor(self.token_tags),
            image_embeds=embeds.pop("image_embeds"), video_embeds=embeds.pop("video_embeds", None), extras=embeds,
            grid_thw=_tensor(self.grid_thw, np.int64), image_spans=_tensor(self.image_spans, np.int64),
            position_ids=_tensor(self.position_ids, np.int64), rope_delta=self.rope_delta,
            loss_mask=_tensor(self.loss_mask), video_spans=_tensor(self.video_spans, np.int64),
            video_grid_thw=_tensor(self.video_grid_thw, np.int64),
            second_per_grid_ts=_tensor(self.second_per_grid_ts, np.float64))


def _tensor(values: np.ndarray | None, dtype: type | None = None) -> torch.Tensor | None:
    """A tensor of its own (a copy: the record's arrays view a shard's buffers), as `dtype`; None stays None (a
    column the record holds no value of)."""
    return None if values is None else torch.from_numpy(values.astype(dtype or values.dtype))


def _array(values: torch.Tensor | None) -> np.ndarray | None:
    return None if values is None else values.numpy(force=True)


def record_arrays(record: RecordTensors) -> RecordArrays:
    """A record read as tensors (read_run, `datasets` rows) in the form packing reads."""
    embeds = {"image_embeds": record.image_embeds, **record.extras}
    if record.video_embeds is not None:
        embeds["video_embeds"] = record.video_embeds
    return RecordArrays(
        id=record.id, input_ids=_array(record.input_ids), token_tags=_array(record.token_tags),
        image_spans=_array(record.image_spans), grid_thw=_array(record.grid_thw),
        position_ids=_array(record.position_ids),
        embeds={name: _as_bits(rows) for name, rows in embeds.items()}, embed_dtype=record.image_embeds.dtype,
        rope_delta=record.rope_delta, loss_mask=_array(record.loss_mask), video_spans=_array(record.video_spans),
        video_grid_thw=_array(record.video_grid_thw), second_per_grid_ts=_array(record.second_per_grid_ts))


def _one_array(column: pa.ChunkedArray) -> pa.Array:
    """The column as one array: its only chunk as it is, or its chunks (one per row group read) combined."""
    return column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)


def _flat_values(column: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """A (nested) list column as its values, flat, and each row's bounds in them ([rows + 1]): the row bounds
    followed down the offsets of every level. A struct's fields become the columns of an [n, fields] array."""
    array = _one_array(column)
    bounds = np.arange(len(array) + 1)
    while True:
        if pa.types.is_fixed_size_list(array.type):
            bounds = (bounds + array.offset) * array.type.list_size
        elif pa.types.is_list(array.type):
            bounds = array.offsets.to_numpy()[bounds]
        else:
            break
        array = array.values  # the whole child, whatever slice of it this array covers: hence the bounds
    fields = [f.to_numpy(zero_copy_only=False)[bounds[0]:bounds[-1]]
              for f in (array.flatten() if pa.types.is_struct(array.type) else [array])]
    return (np.stack(fields, axis=-1) if len(fields) > 1 else fields[0]), bounds - bounds[0]


def _flat_embeddings(column: pa.ChunkedArray, element_size: int, hidden: int,
                     valid: list[bool] | None = None) -> _FlatColumn:
    """A large_binary embedding column as one [rows, hidden] view of its bits on the Arrow data buffer (no copy),
    and each record's bounds in its rows; `valid`: the records that hold rows (a null record has none)."""
    array = _one_array(column)
    _, offsets, data = array.buffers()
    bytes_at = np.frombuffer(offsets, dtype=np.int64)[array.offset:array.offset + len(array) + 1]
    bits = _BITS[element_size]
    rows = (np.frombuffer(data, dtype=bits, count=int(bytes_at[-1] - bytes_at[0]) // element_size,
                          offset=int(bytes_at[0])) if data is not None else np.zeros(0, bits)).reshape(-1, hidden)
    return _FlatColumn(rows, (bytes_at - bytes_at[0]) // (element_size * hidden), valid)


@dataclass(frozen=True)
class _FlatColumn:
    """A column of a shard converted once: its values flat, each record's bounds in them, and whether each record
    holds a value (None: every record does). A record's value is then one slice."""

    values: np.ndarray
    bounds: np.ndarray
    valid: list[bool] | None = None
    row_shape: tuple[int, ...] | None = None  # a record's value reshaped (position_ids: 3 lists of its tokens)

    @classmethod
    def of(cls, column: pa.ChunkedArray, width: int = 1, nullable: bool = False,
           row_shape: tuple[int, ...] | None = None) -> _FlatColumn:
        """A list column, `width` flat values an item (a grid's t, h, w) and, `nullable`, a null record as None."""
        values, bounds = _flat_values(column)
        return cls(values.reshape(-1, width) if width > 1 else values, bounds // width,
                   column.is_valid().to_pylist() if nullable else None, row_shape)

    def at(self, i: int) -> np.ndarray | None:
        if self.valid is not None and not self.valid[i]:
            return None
        values = self.values[self.bounds[i]:self.bounds[i + 1]]
        return values.reshape(self.row_shape) if self.row_shape is not None else values


class ShardColumns:
    """A data shard's columns converted once, flat, with each record's bounds in them; a record is then a
    handful of slices of them. Embeddings stay views on the Arrow buffers."""

    def __init__(self, table: pa.Table):
        self.embed_dtype, hidden = embedding_layout(table.schema)
        element_size = self.embed_dtype.itemsize
        column = table.column
        self.ids = column("id").to_pylist()
        self.rope = column("rope_delta").to_pylist()
        self.input_ids, self.token_tags = _FlatColumn.of(column("input_ids")), _FlatColumn.of(column("token_tags"))
        self.image_spans, self.grid_thw = _FlatColumn.of(column("image_spans")), _FlatColumn.of(column("grid_thw"), 3)
        self.position_ids = _FlatColumn.of(column("position_ids"), nullable=True, row_shape=(3, -1))
        self.loss_mask = _FlatColumn.of(column("loss_mask"), nullable=True)  # a plain text's row holds a null
        # Clips (a record without any holds nulls), and each clip's grid and time step (a format-2 run upgraded holds
        # nulls there: the record then has neither).
        self.video_spans = _FlatColumn.of(column("video_spans"), nullable=True)
        self.video_grid_thw = _FlatColumn.of(column("video_grid_thw"), 3, nullable=True)
        self.second_per_grid_ts = _FlatColumn.of(column("second_per_grid_ts"), nullable=True)
        # Embedding rows: a record's clip rows (as wide as the images') where it holds clips, and the extra outputs
        # the family has (their hidden sizes are in the metadata).
        self.embeds = {"image_embeds": _flat_embeddings(column("image_embeds"), element_size, hidden),
                       "video_embeds": _flat_embeddings(column("video_embeds"), element_size, hidden,
                                                        self.video_spans.valid)}
        for name in EXTRA_OUTPUTS:
            if (size := _hidden_size(table.schema, name)) is not None:
                self.embeds[name] = _flat_embeddings(column(name), element_size, size,
                                                     column(name).is_valid().to_pylist())

    def __len__(self) -> int:
        return len(self.ids)

    def record(self, i: int) -> RecordArrays:
        return RecordArrays(
            id=self.ids[i], input_ids=self.input_ids.at(i), token_tags=self.token_tags.at(i),
            image_spans=self.image_spans.at(i), grid_thw=self.grid_thw.at(i), position_ids=self.position_ids.at(i),
            embeds={name: rows for name, column in self.embeds.items() if (rows := column.at(i)) is not None},
            embed_dtype=self.embed_dtype, rope_delta=self.rope[i], loss_mask=self.loss_mask.at(i),
            video_spans=self.video_spans.at(i), video_grid_thw=self.video_grid_thw.at(i),
            second_per_grid_ts=self.second_per_grid_ts.at(i))


def table_tensors(table: pa.Table) -> list[RecordTensors]:
    """Every row of a data shard as tensors, each column converted once; embeddings are views on the Arrow buffers."""
    columns = ShardColumns(table)
    return [columns.record(i).tensors() for i in range(len(columns))]


def read_tensor_group(path: str | Path, group: int) -> pa.Table:
    """The columns ShardColumns reads, of one row group of a shard: a reader's memory is a row group, whatever the
    shard's size. (`pq.read_table` would first discover a dataset at the path.)"""
    file = checked_file(path)
    return file.read_row_group(group, columns=list(TENSOR_COLUMNS))


def checked_file(path: str | Path) -> pq.ParquetFile:
    """A shard opened, FormatError unless it is written in the format this batchvlm reads."""
    file = pq.ParquetFile(path)
    check_format(format_of(file.schema_arrow.metadata), str(path))
    return file


def row_group_starts(file: pq.ParquetFile) -> np.ndarray:
    """The first row of each of a shard's row groups, then its row count: from the footer, without reading a row."""
    metadata = file.metadata
    return np.cumsum([0] + [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)])


def row_group_of(starts: np.ndarray, row: int) -> int | None:
    """The row group (of `row_group_starts`) holding a shard's `row`; None past the shard's last row."""
    if not 0 <= row < starts[-1]:
        return None
    return int(np.searchsorted(starts, row, side="right")) - 1


def tensors_of(table: pa.Table, index: int) -> RecordTensors:
    """Row `index` of a data shard as tensors; image_embeds is a view on the Arrow buffer."""
    return table_tensors(table.slice(index, 1))[0]


def read_shard(path: str | Path, skip_rows: set[int] = frozenset()) -> Iterator[RecordTensors]:
    """A shard's rows as tensors, a row group at a time; `skip_rows` are input rows to leave out."""
    file = checked_file(path)
    for group in range(file.num_row_groups):
        table = file.read_row_group(group)
        rows = table.column("row").to_pylist()
        yield from (record for row, record in zip(rows, table_tensors(table)) if row not in skip_rows)


class RunNotFinished(RuntimeError):
    """The run is not finished: its units may still change, so reading it is refused unless asked for."""


Runs = str | Path | Sequence[str | Path]
"""What a reader reads as one dataset: a run directory, or a run and its requeue runs (`requeue_from=`), each after
the run it requeued: the records the run quarantined and a requeue wrote are read with the run's."""


def run_layouts(runs: Runs) -> list[RunLayout]:
    """The runs of `runs`, each after the first checked to be a requeue run of one before it (its lineage says which)
    and of the first's fingerprint (ValueError naming them). A requeue writes only ids its run did not, so the runs
    hold each record once, but for two requeues of the same records (trusted_shards refuses those)."""
    layouts = [RunLayout(Path(run)) for run in ([runs] if isinstance(runs, (str, Path)) else runs)]
    if not layouts:
        raise ValueError("no run directory to read")
    for layout in layouts:
        if layout.root.is_file():  # its layout's paths would fail as "not a directory" inside the run
            raise ValueError(f"{layout.root} is a file, not a run directory")
        check_run_format(layout)
    first = read_json(layouts[0].fingerprint) if len(layouts) > 1 else None
    for position, layout in enumerate(layouts[1:], 1):
        _check_requeue_of(layout, layouts[:position])
        if (fingerprint := read_json(layout.fingerprint)) != first:
            raise ValueError(f"{layout.root} was written with another fingerprint than {layouts[0].root} "
                             f"({differences(first or {}, fingerprint or {})}): their rows are not one dataset")
    return layouts


def _check_requeue_of(layout: RunLayout, earlier: list[RunLayout]) -> None:
    lineage = read_json(layout.lineage)
    if lineage is None:
        raise ValueError(f"{layout.root} is not a requeue run (no {layout.name_of(layout.lineage)}): the runs read "
                         f"together are a run and its requeue runs, each after the run it requeued")
    origin = Path(lineage["requeue_from"])
    # by its folder where the runs were moved since (a copy to the training cluster)
    if not any(run.root.resolve() == origin or run.root.name == origin.name for run in earlier):
        raise ValueError(f"{layout.root} requeued {origin}, which is not before it in the runs given "
                         f"({', '.join(str(run.root) for run in earlier)})")


@dataclass(frozen=True)
class TrustedShard:
    """A data shard that a manifest of `run` lists, checked against it, and its rows a reader leaves out: the later
    occurrences of an id that the run's duplicate pass listed."""

    run: RunLayout
    path: Path
    skipped: frozenset[int]


def trusted_shards(runs: Runs, allow_unfinished: bool = False, checksums: bool = False) -> list[TrustedShard]:
    """What every reader reads of a run (or of a run and its requeue runs, `run_layouts`): the data shards the
    manifests list, each checked against its manifest (its size; its sha256 with `checksums`: DamagedFile naming a
    shard that differs). A run that is not finished is refused unless `allow_unfinished`."""
    shards = []
    for layout in run_layouts(runs):
        if not layout.success.exists() and not allow_unfinished:
            raise RunNotFinished(f"{layout.root} has no {layout.name_of(layout.success)}: the run is unfinished or "
                                 "still running; finish it, or pass allow_unfinished=True to read its committed units")
        excluded = excluded_rows(layout)
        shards += [TrustedShard(layout, path, frozenset(excluded.get(unit, ())))
                   for unit, path in checked_shards(layout, DATA, checksums)]
    _check_requeues_apart(shards)
    return shards


def _check_requeues_apart(shards: list[TrustedShard]) -> None:
    """No id in two requeue runs (two requeues of the same records): their ids are read, a requeue's few."""
    first_run = shards[0].run if shards else None
    seen: dict[str, Path] = {}
    for shard in shards:
        if shard.run == first_run:
            continue
        table = pq.read_table(shard.path, columns=["id", "row"])
        for record_id, row in zip(table.column("id").to_pylist(), table.column("row").to_pylist()):
            if row in shard.skipped:
                continue
            if seen.setdefault(record_id, shard.run.root) != shard.run.root:
                raise ValueError(f"id {record_id!r} is written by both {seen[record_id]} and {shard.run.root} (two "
                                 "requeues of the same records): read one of them")


def read_run(runs: Runs, allow_unfinished: bool = False, checksums: bool = False) -> Iterator[RecordTensors]:
    """Every committed record of a finished run, or of a run and its requeue runs (an unfinished one with
    `allow_unfinished`), leaving out the later occurrences of an id that the duplicate pass listed; each shard checked
    against its manifest first."""
    for shard in trusted_shards(runs, allow_unfinished, checksums):
        yield from read_shard(shard.path, shard.skipped)
