"""Sources: Hugging Face `datasets` inputs cut into work units, images kept as bytes.

Each input file (a Parquet file, a `save_to_disk` folder, an imagefolder) is loaded with
`datasets`, image columns are cast to `Image(decode=False)` so that batchvlm decides what a bad
image does, and the rows are cut into units whose ids derive from the file and the row range.
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import datasets

from batchvlm.config import ConfigError, DatasetConfig
from batchvlm.records import ImageRef, SourceRecord, WorkUnit


@dataclass
class InputFile:
    name: str  # stable, human-readable, unique within the source
    location: str  # what a user would open: the file or folder path
    dataset: datasets.Dataset
    root: Path  # relative image paths resolve against this


def _as_bytes_images(dataset: datasets.Dataset, column: str) -> datasets.Dataset:
    feature = dataset.features[column]
    if isinstance(feature, datasets.Image):
        return dataset.cast_column(column, datasets.Image(decode=False))
    inner = getattr(feature, "feature", None)
    if isinstance(inner, datasets.Image):
        return dataset.cast_column(column, datasets.List(datasets.Image(decode=False)))
    return dataset


def _stable_name(location: str, root: str) -> str:
    relative = os.path.relpath(location, root) if root else os.path.basename(location)
    relative = relative.removesuffix(".parquet")
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", relative).strip("_.") or "input"
    return f"{stem}-{hashlib.sha256(relative.encode()).hexdigest()[:8]}"


def _parquet_files(pattern: str) -> list[str]:
    path = Path(pattern)
    if path.is_dir():
        files = sorted(str(p) for p in path.rglob("*.parquet"))
    else:
        files = sorted(glob.glob(pattern, recursive=True))
    if not files:
        raise ConfigError(f"dataset.path={pattern!r} matches no Parquet file")
    return files


def _load_inputs(cfg: DatasetConfig) -> list[InputFile]:
    if cfg.kind in ("demo", "parquet"):
        pattern = str(_demo_path()) if cfg.kind == "demo" else cfg.path
        files = _parquet_files(pattern)
        root = os.path.commonpath([os.path.dirname(os.path.abspath(f)) for f in files])
        return [InputFile(_stable_name(os.path.abspath(f), root), f,
                          datasets.load_dataset("parquet", data_files=[f], split="train"), Path(f).parent)
                for f in files]
    if not Path(cfg.path).exists():
        raise ConfigError(f"dataset.path={cfg.path!r} does not exist")
    if cfg.kind == "disk":
        loaded = datasets.load_from_disk(cfg.path)
    else:
        loaded = datasets.load_dataset("imagefolder", data_dir=cfg.path)
    if isinstance(loaded, datasets.DatasetDict):
        if cfg.split not in loaded:
            raise ConfigError(f"dataset.split={cfg.split!r} is not in {cfg.path} (splits: {', '.join(loaded)})")
        loaded = loaded[cfg.split]
    return [InputFile(_stable_name(os.path.abspath(cfg.path), ""), cfg.path, loaded, Path(cfg.path))]


def _demo_path() -> Path:
    from batchvlm.demo import demo_dataset

    return demo_dataset()


class Source:
    """The inputs of a job, validated, cut into work units, readable from any worker process."""

    def __init__(self, cfg: DatasetConfig):
        self.cfg = cfg
        self.inputs = {}
        for item in _load_inputs(cfg):
            self._check_columns(item)
            item.dataset = _as_bytes_images(item.dataset, cfg.images_column)
            if cfg.limit is not None:
                item.dataset = item.dataset.select(range(min(cfg.limit, len(item.dataset))))
            self.inputs[item.name] = item
        self.duplicates = self._find_duplicates()

    def _check_columns(self, item: InputFile) -> None:
        columns = item.dataset.column_names
        required = {"dataset.images_column": self.cfg.images_column, "dataset.text_column": self.cfg.text_column}
        if self.cfg.kind != "imagefolder":
            required["dataset.id_column"] = self.cfg.id_column
        for key, column in required.items():
            if column not in columns:
                raise ConfigError(f"{key}={column!r} is not a column of {item.location} "
                                  f"(columns: {', '.join(columns)})")

    def _has_ids(self, item: InputFile) -> bool:
        return self.cfg.id_column in item.dataset.column_names

    def _find_duplicates(self) -> set[tuple[str, int]]:
        """(input, row) of every id already seen earlier in the input: kept once, quarantined after."""
        counts: Counter = Counter()
        repeats = set()
        for name, item in self.inputs.items():
            if not self._has_ids(item):
                continue
            for row, value in enumerate(item.dataset[self.cfg.id_column]):
                if value is None:
                    continue
                key = str(value)
                counts[key] += 1
                if counts[key] > 1:
                    repeats.add((name, row))
        return repeats

    def units(self) -> list[WorkUnit]:
        size = self.cfg.unit_size
        return [WorkUnit(f"{name}-{start:08d}-{min(start + size, len(item.dataset)):08d}", name, start,
                         min(start + size, len(item.dataset)))
                for name, item in self.inputs.items() for start in range(0, len(item.dataset), size)]

    def records(self, unit: WorkUnit):
        item = self.inputs[unit.source]
        rows = item.dataset[unit.start:unit.stop]
        for offset in range(unit.num_rows):
            row = unit.start + offset
            images = rows[self.cfg.images_column][offset]
            yield SourceRecord(
                id=self._record_id(item, rows, offset, row, images),
                unit_id=unit.unit_id, source=item.location, row=row,
                text=rows[self.cfg.text_column][offset] or "",
                images=[self._image_ref(image, item.root) for image in _as_list(images)])

    def is_duplicate(self, unit: WorkUnit, row: int) -> bool:
        return (unit.source, row) in self.duplicates

    def _record_id(self, item: InputFile, rows: dict, offset: int, row: int, images) -> str | None:
        if self._has_ids(item):
            value = rows[self.cfg.id_column][offset]
            return None if value is None or str(value) == "" else str(value)
        # imagefolder without an id column: the image's own path inside the folder is its key
        first = _as_list(images)[0] if _as_list(images) else None
        path = first.get("path") if isinstance(first, dict) else None
        return os.path.relpath(path, item.root) if path else f"{item.name}:{row}"

    def _image_ref(self, image, root: Path) -> ImageRef:
        if isinstance(image, dict):
            if image.get("bytes") is not None:
                return ImageRef(data=image["bytes"], path=image.get("path"))
            image = image.get("path")
        if isinstance(image, (bytes, bytearray)):
            return ImageRef(data=bytes(image))
        if isinstance(image, str):
            base = Path(self.cfg.image_root) if self.cfg.image_root else root
            path = Path(image)
            return ImageRef(path=str(path if path.is_absolute() else base / path))
        return ImageRef(data=b"")


def _as_list(images) -> list:
    if images is None:
        return []
    return list(images) if isinstance(images, (list, tuple)) else [images]
