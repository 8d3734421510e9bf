"""Parquet inputs read with pyarrow straight from the files (local or fsspec), a row group at a time.

Units come from the footers: consecutive row groups up to `dataset.unit_records` rows and
`dataset.unit_bytes` compressed bytes. Nothing is copied into a cache, and a worker holds one
record batch of one row group at a time.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import pyarrow.parquet as pq

from batchvlm.config import ConfigError
from batchvlm.records import InputFile, SourceRecord, WorkUnit
from batchvlm.sources import Source
from batchvlm.sources.columns import check_column_types
from batchvlm.sources.files import list_files, open_input, parent_of
from batchvlm.sources.rows import cut_units, record_from_row, record_id, video_column

FOOTER_BLOCK = 1 << 16
"""Read size for footers of remote files: fsspec's default blocks (MBs) would fetch data pages too."""
FOOTER_READERS = 16
BATCH_ROWS = 64


class ParquetSource(Source):
    def list_inputs(self) -> list[InputFile]:
        if self.cfg.kind == "demo":
            from batchvlm.demo import demo_dataset

            return list_files(str(demo_dataset()), (".parquet",), {})
        return list_files(self.cfg.path, (".parquet",), self.cfg.storage_options)

    def _open(self, item: InputFile, **options) -> pq.ParquetFile:
        try:
            return pq.ParquetFile(open_input(item.location, self.cfg.storage_options, **options))
        except FileNotFoundError:
            raise  # a file a pattern named that is not there: its unit's record says so (Source.unit_records)
        except (OSError, pa.ArrowException) as error:
            raise ConfigError(f"dataset.path: {item.location} is not a readable Parquet file ({error})") from None

    def _columns(self, item: InputFile, file: pq.ParquetFile) -> list[str]:
        names = file.schema_arrow.names
        wanted = {"dataset.id_column": self.cfg.id_column, "dataset.images_column": self.cfg.images_column,
                  "dataset.text_column": self.cfg.text_column}
        if self.cfg.status_column is not None:
            wanted["dataset.status_column"] = self.cfg.status_column
        if self.cfg.videos_column is not None:
            wanted["dataset.videos_column"] = self.cfg.videos_column
        for key, column in wanted.items():
            if column not in names and not (key == "dataset.id_column" and self.cfg.missing_ids != "quarantine"):
                raise ConfigError(f"{key}={column!r} is not a column of {item.location} (columns: {', '.join(names)})")
        check_column_types(file.schema_arrow, self.cfg, item.location)
        wanted = {key: column for key, column in wanted.items() if column in names}
        also = [column for column in ("error_message", video_column(self.cfg)) if column in names]
        return list(dict.fromkeys([*wanted.values(), *also]))

    def plan(self) -> Sequence[WorkUnit]:
        if (units := self.pattern_units()) is not None:
            return units
        # Footers are small reads whose time is latency on an object store: many at once, in input order.
        with ThreadPoolExecutor(FOOTER_READERS) as pool:
            return [unit for units in pool.map(self._plan_input, self.inputs.values()) for unit in units]

    def _plan_input(self, item: InputFile) -> list[WorkUnit]:
        file = self._open(item, block_size=FOOTER_BLOCK)
        self._columns(item, file)
        meta = file.metadata
        groups = [(meta.row_group(i).num_rows,
                   sum(meta.row_group(i).column(c).total_compressed_size for c in range(meta.num_columns)))
                  for i in range(meta.num_row_groups)]
        return cut_units(item.name, _limited(groups, self.cfg.limit), self.cfg.unit_records, self.cfg.unit_bytes)

    def _rows(self, item: InputFile, start: int, stop: int | None) -> Iterator[tuple[int, dict]]:
        """(row, values) for rows [start, stop) of a file (stop None: to its end), reading only the row groups that
        hold them."""
        file = self._open(item)
        meta = file.metadata
        stop = meta.num_rows if stop is None else stop
        offset, row, groups = 0, None, []
        for index in range(meta.num_row_groups):
            rows = meta.row_group(index).num_rows
            if offset < stop and offset + rows > start:
                groups.append(index)
                row = offset if row is None else row
            offset += rows
        if not groups:
            return
        for batch in file.iter_batches(batch_size=BATCH_ROWS, row_groups=groups, columns=self._columns(item, file)):
            for values in batch.to_pylist():
                if start <= row < stop:
                    yield row, values
                row += 1
                if row >= stop:
                    return

    def records(self, unit: WorkUnit) -> Iterator[SourceRecord]:
        item = self.inputs[unit.source]
        stop = unit.stop if unit.stop is not None else self.cfg.limit  # a pattern's unit: its file, to the limit
        for seq, (row, values) in enumerate(self._rows(item, unit.start, stop)):
            yield record_from_row(self.cfg, values, unit.unit_id, item, row, seq, parent_of(item.location))

    def records_at(self, name: str, rows: list[int]) -> Iterator[SourceRecord]:
        item, wanted = self.inputs[name], set(rows)
        if not rows:
            return
        for row, values in self._rows(item, rows[0], rows[-1] + 1):
            if row in wanted:
                yield record_from_row(self.cfg, values, name, item, row, row, parent_of(item.location))

    def all_ids(self, name: str) -> Iterator[tuple[int, str | None]]:
        item = self.inputs[name]
        file = self._open(item)
        if self.cfg.missing_ids != "quarantine":  # an id may be made from the whole row
            for row, values in self._rows(item, 0, file.metadata.num_rows):
                yield row, record_id(self.cfg, values, name, row)
            return
        row = 0
        for batch in file.iter_batches(batch_size=65536, columns=[self.cfg.id_column]):
            for value in batch.column(0).to_pylist():
                yield row, None if value is None or str(value) == "" else str(value)
                row += 1


def _limited(groups: list[tuple[int, int]], limit: int | None) -> list[tuple[int, int]]:
    """dataset.limit: only the first `limit` rows of each file."""
    if limit is None:
        return groups
    kept, left = [], limit
    for rows, size in groups:
        if left <= 0:
            break
        take = min(rows, left)
        kept.append((take, size * take // rows if rows else 0))
        left -= take
    return kept


SOURCE = ParquetSource
