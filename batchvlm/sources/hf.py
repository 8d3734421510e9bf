"""Hugging Face `datasets` inputs: a `save_to_disk` folder and an imagefolder (memory-mapped Arrow, cut into
row ranges), and a hub dataset (or a local dataset folder) streamed, one unit per shard. Image columns are
read as bytes (`Image(decode=False)`), so that batchvlm, not the loader, decides what a bad image does.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from functools import cached_property

import datasets

from batchvlm.config import ConfigError
from batchvlm.records import InputFile, SourceRecord, WorkUnit
from batchvlm.sources import Source
from batchvlm.sources.columns import check_column_types
from batchvlm.sources.files import stable_name
from batchvlm.sources.rows import cut_units, record_from_row, video_column

datasets.disable_progress_bars()  # the job's own progress covers the reading


def as_bytes_images(dataset, column: str, kind=datasets.Image):
    """The column's Image (with `kind=datasets.Video`, Video) feature, or list of them, left undecoded: {bytes, path}
    structs, which the job's own decoder reads."""
    feature = dataset.features[column] if dataset.features else None
    if isinstance(feature, kind):
        return dataset.cast_column(column, kind(decode=False))
    if isinstance(getattr(feature, "feature", None), kind):
        return dataset.cast_column(column, datasets.List(kind(decode=False)))
    return dataset


def _split(loaded, cfg):
    if isinstance(loaded, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        if cfg.split not in loaded:
            raise ConfigError(f"dataset.split={cfg.split!r} is not in {cfg.path} (splits: {', '.join(loaded)})")
        return loaded[cfg.split]
    return loaded


class HFSource(Source):
    def list_inputs(self) -> list[InputFile]:
        if self.cfg.kind != "hub" and not os.path.exists(self.cfg.path):
            raise ConfigError(f"dataset.path={self.cfg.path!r} does not exist")
        return [InputFile(stable_name(os.path.abspath(self.cfg.path) if self.cfg.kind != "hub" else self.cfg.path, ""),
                          self.cfg.path, identity=self._identity())]

    def _identity(self) -> dict:
        """The dataset's own fingerprint and rows (a streamed one: its shards, and its files where they are local),
        so that a dataset appended to or rebuilt is not taken for the one a run was planned from."""
        if not self.streaming:
            return {"fingerprint": self.dataset._fingerprint, "rows": len(self.dataset)}
        identity = {"shards": self.dataset.num_shards}
        if os.path.isdir(self.cfg.path):
            files = [os.path.join(folder, name) for folder, _, names in os.walk(self.cfg.path) for name in names]
            identity.update(files=len(files), bytes=sum(os.path.getsize(f) for f in files),
                            mtime=str(max((os.path.getmtime(f) for f in files), default=0)))
        return identity

    @cached_property
    def dataset(self):
        """The dataset, loaded once per process (a worker loads its own: Arrow files are memory-mapped)."""
        cfg = self.cfg
        if cfg.kind == "disk":
            loaded = datasets.load_from_disk(cfg.path)
        elif cfg.kind == "imagefolder":
            loaded = datasets.load_dataset("imagefolder", data_dir=cfg.path)
        else:
            loaded = datasets.load_dataset(cfg.path, streaming=True, storage_options=cfg.storage_options or None)
        dataset = _split(loaded, cfg)
        self._check_columns(dataset)
        dataset = as_bytes_images(dataset, cfg.images_column)
        clips = video_column(cfg)
        return as_bytes_images(dataset, clips, datasets.Video) if clips in (dataset.features or {}) else dataset

    def _check_columns(self, dataset) -> None:
        columns = dataset.column_names or list(dataset.features or [])
        required = {"dataset.images_column": self.cfg.images_column, "dataset.text_column": self.cfg.text_column}
        if self.cfg.kind != "imagefolder" and self.cfg.missing_ids == "quarantine":
            required["dataset.id_column"] = self.cfg.id_column
        if self.cfg.videos_column is not None:
            required["dataset.videos_column"] = self.cfg.videos_column
        for key, column in required.items():
            if column not in columns:
                raise ConfigError(f"{key}={column!r} is not a column of {self.cfg.path} (columns: {', '.join(columns)})")
        if dataset.features is not None:
            check_column_types(dataset.features.arrow_schema, self.cfg, self.cfg.path)

    @property
    def streaming(self) -> bool:
        return self.cfg.kind == "hub"

    def plan(self) -> list[WorkUnit]:
        (item,) = self.inputs.values()
        if self.streaming:
            shards = self.dataset.num_shards
            return [WorkUnit(f"{item.name}-shard{index:05d}", item.name, index, None) for index in range(shards)]
        rows = len(self.dataset) if self.cfg.limit is None else min(self.cfg.limit, len(self.dataset))
        return cut_units(item.name, [(rows, 0)], self.cfg.unit_records, self.cfg.unit_bytes)

    def _record(self, values: dict, unit_id: str, row: int, seq: int) -> SourceRecord:
        (item,) = self.inputs.values()
        return record_from_row(self.cfg, values, unit_id, item, row, seq, self.cfg.path,
                               id_value=self._path_id(values, row) if self.cfg.kind == "imagefolder" and
                               self.cfg.id_column not in values else None)

    def _path_id(self, values: dict, row: int) -> str:
        """An imagefolder without an id column: the first image's path inside the folder is the record's key."""
        images = values.get(self.cfg.images_column)
        first = (images[0] if images else None) if isinstance(images, list) else images
        path = first.get("path") if isinstance(first, dict) else None
        return os.path.relpath(path, self.cfg.path) if path else f"{next(iter(self.inputs))}:{row}"

    def records(self, unit: WorkUnit) -> Iterator[SourceRecord]:
        if self.streaming:
            shard = self.dataset.shard(num_shards=self.dataset.num_shards, index=unit.start)
            for seq, values in enumerate(shard):
                if seq >= (self.cfg.limit or float("inf")):
                    return
                yield self._record(values, unit.unit_id, seq, seq)
            return
        for seq, row in enumerate(range(unit.start, unit.stop)):
            yield self._record(self.dataset[row], unit.unit_id, row, seq)

    def records_at(self, name: str, rows: list[int]) -> Iterator[SourceRecord]:
        if self.streaming:
            raise ConfigError("requeue_from needs random access to rows; dataset.kind=hub streams: requeue from a "
                              "local copy of the dataset (dataset.kind=parquet or disk)")
        for row in rows:
            yield self._record(self.dataset[row], name, row, row)

    def all_ids(self, name: str) -> Iterator[tuple[int, str | None]]:
        if self.cfg.id_column in self.dataset.column_names and self.cfg.missing_ids == "quarantine":
            for row, value in enumerate(self.dataset.select_columns([self.cfg.id_column])[self.cfg.id_column]):
                yield row, None if value is None or str(value) == "" else str(value)
        else:
            for row in range(len(self.dataset)):
                yield row, self._record(self.dataset[row], name, row, row).id


SOURCE = HFSource
