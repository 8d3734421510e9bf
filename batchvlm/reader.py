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
        return torch.cat([torch.arange(s, s + n) for s, n in self.image_spans.tolist()]) \
            if len(self.image_spans) else torch.zeros(0, dtype=torch.int64)


def embedding_layout(schema: pa.Schema) -> tuple[torch.dtype, int]:
    meta = schema.metadata or {}
    return _DTYPES[meta[b"batchvlm.embed_dtype"].decode()], int(meta[b"batchvlm.hidden_size"])


def _hidden_size(schema: pa.Schema, name: str) -> int | None:
    value = (schema.metadata or {}).get(f"batchvlm.hidden_size.{name}".encode())
    return int(value) if value is not None else None


def _embeddings(table: pa.Table, name: str, index: int, dtype: torch.dtype, hidden: int) -> torch.Tensor:
    """One row's embedding column as a [rows, hidden] view on the Arrow buffer (no copy)."""
    blob = _value_buffer(table.column(name), index)
    if blob.size == 0:
        return torch.zeros((0, hidden), dtype=dtype)
    with warnings.catch_warnings():
        # Arrow buffers are read-only; the tensor is a view on them, which is the point.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(memoryview(blob), dtype=dtype).view(-1, hidden)


def _value_buffer(column: pa.ChunkedArray, index: int) -> pa.Buffer:
    """The bytes of one large_binary value as a slice of the column's data buffer (no copy)."""
    for chunk in column.chunks:
        if index < len(chunk):
            _, offsets, data = chunk.buffers()
            start, stop = (int(v) for v in memoryview(offsets).cast("q")[chunk.offset + index:chunk.offset + index + 2])
            return data.slice(start, stop - start) if data is not None else pa.py_buffer(b"")
        index -= len(chunk)
    raise IndexError(index)


def _row_tensors(column: pa.ChunkedArray, dtype: torch.dtype) -> list[torch.Tensor]:
    """A (nested) list column as one flat tensor per row, converted in one pass: every level flattened,
    the values split where their row changes. A struct's fields become the columns of an [n, fields] tensor."""
    array = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    rows = np.arange(len(array))
    while pa.types.is_list(array.type) or pa.types.is_fixed_size_list(array.type):
        rows = rows[pc.list_parent_indices(array).to_numpy()]
        array = pc.list_flatten(array)
    fields = array.flatten() if pa.types.is_struct(array.type) else [array]
    values = torch.from_numpy(np.stack([f.to_numpy(zero_copy_only=False) for f in fields], axis=-1)).to(dtype)
    return list(values.split(np.bincount(rows, minlength=len(column)).tolist()))


def table_tensors(table: pa.Table) -> list[RecordTensors]:
    """Every row of a data shard as tensors, each column converted once; embeddings are views on the Arrow buffers."""
    dtype, hidden = embedding_layout(table.schema)
    column = table.column
    extras = [(name, size) for name in EXTRA_OUTPUTS if name in table.column_names
              and (size := _hidden_size(table.schema, name)) is not None]
    has_extra = {name: column(name).is_valid().to_pylist() for name, _ in extras}
    tags = _row_tensors(column("token_tags"), torch.int8)
    positions = _row_tensors(column("position_ids"), torch.int64) if "position_ids" in table.column_names else None
    has_positions = column("position_ids").is_valid().to_pylist() if positions is not None else None
    rope = column("rope_delta").to_pylist() if "rope_delta" in table.column_names else [None] * table.num_rows
    return [RecordTensors(
        id=record_id,
        input_ids=input_ids[:, 0],
        image_embeds=_embeddings(table, "image_embeds", index, dtype, hidden),
        grid_thw=grid.view(-1, 3),
        image_spans=spans,
        token_tags=tags[index][:, 0],
        extras={name: _embeddings(table, name, index, dtype, size) for name, size in extras if has_extra[name][index]},
        position_ids=positions[index].view(3, -1) if positions is not None and has_positions[index] else None,
        rope_delta=rope[index],
    ) for index, (record_id, input_ids, grid, spans) in enumerate(zip(
        column("id").to_pylist(), _row_tensors(column("input_ids"), torch.int64),
        _row_tensors(column("grid_thw"), torch.int64), _row_tensors(column("image_spans"), torch.int64)))]


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
