"""Rows to records: units cut from row groups, and a dataset row (column -> value) read as a SourceRecord."""

from __future__ import annotations

import os
import posixpath

from batchvlm.checks import CheckFailed, failure
from batchvlm.records import Failure, ImageRef, SourceRecord, WorkUnit
from batchvlm.sources.config import DatasetConfig
from batchvlm.sources.conversations import read_turns, turns_text


def cut_units(name: str, groups: list[tuple[int, int]], max_records: int, max_bytes: int) -> list[WorkUnit]:
    """Consecutive (rows, bytes) groups (Parquet row groups) joined into units of at most max_records rows
    and max_bytes bytes; a group larger than either is cut into row ranges of one size (the last shorter)."""
    units: list[WorkUnit] = []
    start = stop = nbytes = 0

    def close() -> None:
        nonlocal start, nbytes
        if stop > start:
            units.append(WorkUnit(f"{name}-{start:08d}-{stop:08d}", name, start, stop, nbytes))
        start, nbytes = stop, 0

    for rows, size in groups:
        if stop > start and (stop - start + rows > max_records or nbytes + size > max_bytes):
            close()
        pieces = max(1, -(-rows // max_records), -(-size // max_bytes))
        chunk = -(-rows // pieces) if rows else 0
        for first in range(0, rows, chunk) if rows else []:
            piece_rows = min(chunk, rows - first)
            stop += piece_rows
            nbytes += size * piece_rows // rows
            if pieces > 1:
                close()
    close()
    return units


def record_from_row(cfg: DatasetConfig, row: dict, unit_id: str, source: str, index: int, seq: int,
                    base: str, id_value=None) -> SourceRecord:
    """A dataset row (column -> value, as pyarrow or datasets give it) as a SourceRecord."""
    images = _as_list(row.get(cfg.images_column))
    record_id = row.get(cfg.id_column) if id_value is None else id_value
    record = SourceRecord(id=None if record_id is None or str(record_id) == "" else str(record_id),
                          unit_id=unit_id, source=source, row=index, text=row.get(cfg.text_column) or "",
                          images=[image_ref(image, base, cfg) for image in images], seq=seq)
    record.failure = source_failure(cfg, row, record)
    if cfg.format != "text" and record.failure is None:
        try:
            record.turns = read_turns(cfg.format, row.get(cfg.text_column), cfg.placeholder, len(images),
                                      cfg.image_first, cfg.text_column)
            record.text = turns_text(record.turns, cfg.placeholder)
        except CheckFailed as failed:
            record.text, record.failure = str(row.get(cfg.text_column)), failed.to_failure()
    return record


def source_failure(cfg: DatasetConfig, row: dict, record: SourceRecord) -> Failure | None:
    """img2dataset's failed downloads (status != success), and image-less rows where images are required."""
    if cfg.status_column is not None and row.get(cfg.status_column) != "success":
        error = row.get("error_message")
        return failure("source.download_failed", f"the image was not downloaded: {cfg.status_column}="
                       f"{row.get(cfg.status_column)!r}" + (f" ({error})" if error else ""),
                       expected="success", observed=repr(row.get(cfg.status_column)))
    if cfg.require_images and not any(ref.data or ref.path for ref in record.images):
        return failure("source.missing_image", f"the row has no image in {cfg.images_column!r}",
                       expected="at least one image", observed="none")
    return None


def image_ref(image, base: str, cfg: DatasetConfig) -> ImageRef:
    """Bytes, an HF Image struct ({bytes, path}) or a path; relative paths resolve against `base`
    (dataset.image_root, else the input's own folder, which may be remote)."""
    if isinstance(image, dict):
        if image.get("bytes") is not None:
            return ImageRef(data=image["bytes"], path=image.get("path"))
        if image.get("size") is not None:  # a member a stream source did not read: decode.too_many_bytes
            return ImageRef(path=image["path"], size=image["size"])
        image = image.get("path")
    if isinstance(image, (bytes, bytearray)):
        return ImageRef(data=bytes(image))
    if isinstance(image, str) and image:
        if "://" in image:
            return ImageRef(path=image, storage_options=cfg.storage_options if cfg.fetch_urls else None)
        root = cfg.image_root or base
        path = image if os.path.isabs(image) else posixpath.join(root, image)
        return ImageRef(path=path, storage_options=cfg.storage_options if "://" in path else None, root=root)
    return ImageRef(data=b"")


def _as_list(images) -> list:
    if images is None:
        return []
    return list(images) if isinstance(images, (list, tuple)) else [images]
