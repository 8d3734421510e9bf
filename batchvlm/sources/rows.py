"""Rows to records: units cut from row groups, and a dataset row (column -> value) read as a SourceRecord."""

from __future__ import annotations

import hashlib
import json
import os
import posixpath

from batchvlm.checks import CheckFailed, failure
from batchvlm.format.strings import escaped_value, unencodable_fields
from batchvlm.records import Failure, ImageRef, InputFile, SourceRecord, WorkUnit
from batchvlm.sources.config import DatasetConfig
from batchvlm.sources.conversations import VIDEO_PLACEHOLDER, read_turns, turns_text


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


CONTENT_ID = "sha256:"
"""How an id that dataset.missing_ids=content made begins."""


def record_id(cfg: DatasetConfig, row: dict, name: str, index: int, id_value=None) -> str | None:
    """A row's id: its dataset.id_column (or `id_value`, where the source knows it otherwise), else one made as
    dataset.missing_ids says, else None (the record is quarantined under source.missing_id). `name` is its input's."""
    given = row.get(cfg.id_column) if id_value is None else id_value
    if given is not None and str(given) != "":
        return str(given)
    if cfg.missing_ids == "position":
        return f"{name}#{index}"
    if cfg.missing_ids == "content":
        canonical = json.dumps(row, sort_keys=True, ensure_ascii=False, default=_canonical_value)
        return CONTENT_ID + hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    return None


def _canonical_value(value) -> str:
    """A value JSON has no type for, as the content digest takes it: bytes by their own digest."""
    if isinstance(value, (bytes, bytearray)):
        return "bytes:" + hashlib.sha256(value).hexdigest()
    return f"{type(value).__name__}:{value}"


def record_from_row(cfg: DatasetConfig, row: dict, unit_id: str, item: InputFile, index: int, seq: int,
                    base: str, id_value=None) -> SourceRecord:
    """A dataset row (column -> value, as pyarrow or datasets give it) of input `item` as a SourceRecord: one that
    fails a check as read carries its failure, and only strings a Parquet file can store (see format.strings)."""
    given_id = row.get(cfg.id_column) if id_value is None else id_value
    read = {cfg.id_column or "id": given_id, cfg.text_column: row.get(cfg.text_column),
            cfg.images_column: row.get(cfg.images_column)}
    unencodable = unencodable_fields(read)
    if unencodable:  # kept, escaped, to be quarantined
        row = {**row, **{column: escaped_value(value) for column, value in read.items()}}
        given_id = escaped_value(given_id)
    images = _as_list(row.get(cfg.images_column))
    text = row.get(cfg.text_column)
    record = SourceRecord(id=record_id(cfg, row, item.name, index, given_id), unit_id=unit_id,
                          source=item.location, row=index, text=_as_text(text),
                          images=[image_ref(image, base, cfg) for image in images], seq=seq,
                          videos=video_refs(cfg, row, base))
    record.failure = (unencodable_failure(unencodable, read) if unencodable else None) or id_failure(given_id) \
        or text_failure(cfg, text) or source_failure(cfg, row, record)
    if cfg.format != "text" and (record.failure is None or unencodable):  # an escaped conversation shows its turns
        try:
            record.turns = read_turns(cfg.format, text, cfg.placeholder, len(images), cfg.image_first,
                                      cfg.text_column)
        except CheckFailed as failed:
            record.failure = record.failure or failed.to_failure()
        else:
            if not unencodable:  # (an escaped one's text is its whole column, which its turns may not show)
                record.text = turns_text(record.turns, cfg.placeholder)
    return record


def _as_text(value) -> str:
    """A text column's value as the record's text: a string as it is, anything else as JSON."""
    return "" if value is None else value if isinstance(value, str) else json.dumps(value, ensure_ascii=False,
                                                                                       default=str)


def unencodable_failure(fields: list[str], read: dict) -> Failure:
    """source.invalid_unicode, naming the fields (their strings are stored escaped)."""
    return failure("source.invalid_unicode", f"the record's {', '.join(map(repr, fields))} hold text UTF-8 cannot "
                   "encode (a lone surrogate, or a byte that is not UTF-8); the record is stored with those strings "
                   "as backslash escapes", expected="UTF-8 text",
                   observed=str(escaped_value(read[fields[0]]))[:200])


def id_failure(record_id) -> Failure | None:
    """source.invalid_id: an id is a string or an integer (a null or empty one is source.missing_id's)."""
    if record_id is None or isinstance(record_id, str) or (isinstance(record_id, int) and
                                                            not isinstance(record_id, bool)):
        return None
    return failure("source.invalid_id", f"the id {str(record_id)[:80]!r} is a {type(record_id).__name__}",
                   expected="a string or an integer", observed=type(record_id).__name__)


def text_failure(cfg: DatasetConfig, text) -> Failure | None:
    """A plain text's (dataset.format=text) own checks: text.not_a_string where it is neither a string nor null,
    text.video where it holds a video placeholder and the dataset names no clip column (dataset.videos_column)."""
    if cfg.format != "text" or text is None:
        return None
    if not isinstance(text, str):
        return failure("text.not_a_string", f"the {cfg.text_column!r} column holds a {type(text).__name__}, not a "
                       "string", expected="a string (or null)", observed=type(text).__name__)
    if VIDEO_PLACEHOLDER in text and cfg.videos_column is None:
        return failure("text.video", f"the text holds a {VIDEO_PLACEHOLDER} placeholder and the dataset names no "
                       "clip column (dataset.videos_column)", expected="text and images", observed=VIDEO_PLACEHOLDER)
    return None


VIDEO_COLUMNS = {"llava": "video", "messages": "videos"}
"""Where a conversation format's records name their clips: LLaVA-Video-178K's `video` (a path or a list), LLaMA-Factory's
and ms-swift's `videos`."""


def video_column(cfg: DatasetConfig) -> str | None:
    """Where the dataset's records name their clips: dataset.videos_column, else the format's own (None: no clip)."""
    return cfg.videos_column or VIDEO_COLUMNS.get(cfg.format)


def video_refs(cfg: DatasetConfig, row: dict, base: str) -> list[ImageRef]:
    """The clips a record names in its video column (paths under dataset.image_root, as images, or bytes); none
    where the dataset has no such column."""
    column = video_column(cfg)
    if column is None:
        return []
    return [image_ref(video, base, cfg) for video in _as_list(row.get(column)) if video]


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
