"""Reading the output back: a shard row -> tensors, without copying the embedding bytes."""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from batchvlm.dedup import excluded_rows
from batchvlm.encode import EXTRA_OUTPUTS

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


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

    def image_token_positions(self) -> torch.Tensor:
        """Sequence positions of the image tokens, in the order of the rows of image_embeds."""
        spans = self.image_spans.numpy()
        return torch.from_numpy(span_positions(spans[:, 0], spans[:, 1]))


def span_positions(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """start, start+1, ..., start+length-1 for every span, in span order, in one pass over all spans."""
    before = np.cumsum(lengths) - lengths  # the output index each span begins at
    return np.arange(int(lengths.sum()), dtype=np.int64) + np.repeat(starts - before, lengths)


def embedding_layout(schema: pa.Schema) -> tuple[torch.dtype, int]:
    meta = schema.metadata or {}
    return _DTYPES[meta[b"batchvlm.embed_dtype"].decode()], int(meta[b"batchvlm.hidden_size"])


def _hidden_size(schema: pa.Schema, name: str) -> int | None:
    value = (schema.metadata or {}).get(f"batchvlm.hidden_size.{name}".encode())
    return int(value) if value is not None else None


def _row_embeddings(column: pa.ChunkedArray, dtype: torch.dtype, hidden: int) -> list[torch.Tensor]:
    """Every row of a large_binary embedding column as a [rows, hidden] view on the Arrow data buffer: one
    tensor over the whole buffer, split at the row offsets (no copy). A null row is empty."""
    array = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    _, offsets, data = array.buffers()
    bounds = np.frombuffer(offsets, dtype=np.int64)[array.offset:array.offset + len(array) + 1]
    if data is None or bounds[-1] == bounds[0]:
        return [torch.zeros((0, hidden), dtype=dtype)] * len(array)
    with warnings.catch_warnings():
        # Arrow buffers are read-only; the tensors are views on them, which is the point.
        warnings.simplefilter("ignore", UserWarning)
        values = torch.frombuffer(memoryview(data.slice(int(bounds[0]), int(bounds[-1] - bounds[0]))), dtype=dtype)
    rows_per_record = (np.diff(bounds) // (values.element_size() * hidden)).tolist()
    return list(values.view(-1, hidden).split(rows_per_record))


def _row_tensors(column: pa.ChunkedArray, dtype: torch.dtype) -> list[torch.Tensor]:
    """A (nested) list column as one flat tensor per row, converted in one pass: the row bounds followed down
    the offsets of every level to the values, which are split at them. A struct's fields become the columns
    of an [n, fields] tensor."""
    array = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    bounds = np.arange(len(array) + 1)
    while True:
        if pa.types.is_fixed_size_list(array.type):
            bounds = (bounds + array.offset) * array.type.list_size
        elif pa.types.is_list(array.type):
            bounds = array.offsets.to_numpy()[bounds]
        else:
            break
        array = array.values  # the whole child, whatever slice of it this array covers: hence the bounds
    fields = array.flatten() if pa.types.is_struct(array.type) else [array]
    values = np.stack([f.to_numpy(zero_copy_only=False)[bounds[0]:bounds[-1]] for f in fields], axis=-1)
    return list(torch.from_numpy(values).to(dtype).split(np.diff(bounds).tolist()))


TENSOR_COLUMNS = ("id", "input_ids", "image_embeds", "grid_thw", "image_spans", "token_tags", "position_ids",
                  "rope_delta", *EXTRA_OUTPUTS)
"""The columns table_tensors reads; a reader that only wants tensors need not read the others."""


def table_tensors(table: pa.Table) -> list[RecordTensors]:
    """Every row of a data shard as tensors, each column converted once; embeddings are views on the Arrow buffers."""
    dtype, hidden = embedding_layout(table.schema)
    column = table.column
    extras = {name: (column(name).is_valid().to_pylist(), _row_embeddings(column(name), dtype, size))
              for name in EXTRA_OUTPUTS if name in table.column_names
              and (size := _hidden_size(table.schema, name)) is not None}
    tags = _row_tensors(column("token_tags"), torch.int8)
    positions = _row_tensors(column("position_ids"), torch.int64) if "position_ids" in table.column_names else None
    has_positions = column("position_ids").is_valid().to_pylist() if positions is not None else None
    rope = column("rope_delta").to_pylist() if "rope_delta" in table.column_names else [None] * table.num_rows
    return [RecordTensors(
        id=record_id,
        input_ids=input_ids[:, 0],
        image_embeds=embeds,
        grid_thw=grid.view(-1, 3),
        image_spans=spans,
        token_tags=tags[index][:, 0],
        extras={name: rows[index] for name, (valid, rows) in extras.items() if valid[index]},
        position_ids=positions[index].view(3, -1) if positions is not None and has_positions[index] else None,
        rope_delta=rope[index],
    ) for index, (record_id, input_ids, grid, spans, embeds) in enumerate(zip(
        column("id").to_pylist(), _row_tensors(column("input_ids"), torch.int64),
        _row_tensors(column("grid_thw"), torch.int64), _row_tensors(column("image_spans"), torch.int64),
        _row_embeddings(column("image_embeds"), dtype, hidden)))]


def read_tensor_columns(path: str | Path) -> pa.Table:
    """The columns table_tensors reads, of one shard. (`pq.read_table` would first discover a dataset at the path.)"""
    file = pq.ParquetFile(path)
    present = set(file.schema_arrow.names)
    return file.read(columns=[name for name in TENSOR_COLUMNS if name in present])


def tensors_of(table: pa.Table, index: int) -> RecordTensors:
    """Row `index` of a data shard as tensors; image_embeds is a view on the Arrow buffer."""
    return table_tensors(table.slice(index, 1))[0]


def read_shard(path: str | Path, skip_rows: set[int] = frozenset()) -> Iterator[RecordTensors]:
    """A shard's rows as tensors, a row group at a time; `skip_rows` are input rows to leave out."""
    file = pq.ParquetFile(path)
    for group in range(file.num_row_groups):
        table = file.read_row_group(group)
        rows = table.column("row").to_pylist()
        yield from (record for row, record in zip(rows, table_tensors(table)) if row not in skip_rows)


def committed_units(run_dir: str | Path, kind: str = "data") -> list[tuple[str, Path]]:
    """(unit, shard) for every shard of `kind` that a manifest lists: the only ones a reader may trust.
    A unit with no record of that kind has no such shard."""
    run_dir = Path(run_dir)
    units = []
    for manifest_file in sorted((run_dir / "manifest").glob("*.json")):
        listed = json.loads(manifest_file.read_text())["files"].get(kind)
        if listed is not None:
            units.append((manifest_file.stem, run_dir / listed["path"]))
    return units


def committed_shards(run_dir: str | Path, kind: str = "data") -> list[Path]:
    return [shard for _, shard in committed_units(run_dir, kind)]


def read_run(run_dir: str | Path) -> Iterator[RecordTensors]:
    """Every committed record, leaving out the later occurrences of an id that the duplicate pass listed."""
    excluded = excluded_rows(Path(run_dir))
    for unit, shard in committed_units(run_dir):
        yield from read_shard(shard, excluded.get(unit, frozenset()))
