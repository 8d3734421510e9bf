"""Reading the output back: a shard row -> tensors, without copying the embedding bytes."""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
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


def tensors_of(table: pa.Table, index: int) -> RecordTensors:
    """Row `index` of a data shard as tensors; image_embeds is a view on the Arrow buffer."""
    dtype, hidden = embedding_layout(table.schema)
    column = lambda name: table.column(name)[index]  # noqa: E731
    extras = {name: _embeddings(table, name, index, dtype, size) for name in EXTRA_OUTPUTS
              if name in table.column_names and column(name).is_valid
              and (size := _hidden_size(table.schema, name)) is not None}
    positions = column("position_ids").as_py() if "position_ids" in table.column_names else None
    spans = [(s["start"], s["length"]) for s in column("image_spans").as_py()]
    return RecordTensors(
        id=column("id").as_py(),
        input_ids=torch.tensor(column("input_ids").as_py(), dtype=torch.int64),
        image_embeds=_embeddings(table, "image_embeds", index, dtype, hidden),
        grid_thw=torch.tensor(column("grid_thw").as_py(), dtype=torch.int64).reshape(-1, 3),
        image_spans=torch.tensor(spans, dtype=torch.int64).reshape(-1, 2),
        token_tags=torch.tensor(column("token_tags").as_py(), dtype=torch.int8),
        extras=extras,
        position_ids=torch.tensor(positions, dtype=torch.int64) if positions is not None else None,
        rope_delta=column("rope_delta").as_py() if "rope_delta" in table.column_names else None,
    )


def read_shard(path: str | Path, skip_rows: set[int] = frozenset()) -> Iterator[RecordTensors]:
    """A shard's rows as tensors, a row group at a time; `skip_rows` are input rows to leave out."""
    file = pq.ParquetFile(path)
    for group in range(file.num_row_groups):
        table = file.read_row_group(group)
        rows = table.column("row").to_pylist()
        for index in range(table.num_rows):
            if rows[index] not in skip_rows:
                yield tensors_of(table, index)


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
