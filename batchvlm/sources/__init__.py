"""Sources: a job's inputs, cut into work units from metadata alone, and read back a unit at a time.

One module per kind of input (datatrove's readers/): `parquet` (pyarrow, a row group at a time,
never copied), `webdataset` (tar shards streamed member by member), `hf` (Hugging Face `datasets`:
save_to_disk folders, imagefolders, streamed hub datasets). Every input path may be an fsspec URL
(`s3://`, `gs://`, `hf://`, `file://`); `dataset.storage_options` reach the file system.

Rank 0 lists the inputs and plans the units (`plan`), which costs O(files): Parquet footers, tar
sizes, dataset shard counts; no image byte is read before work starts. Every rank then reads the
units it claims through `records(unit)`, from the inputs the plan names (`from_plan`).
"""

from __future__ import annotations

import hashlib
import importlib
import os
import posixpath
import re
from collections.abc import Iterator

import fsspec
import pyarrow as pa

from batchvlm.checks import CheckFailed, failure
from batchvlm.config import ConfigError
from batchvlm.sources.config import DatasetConfig
from batchvlm.records import Failure, ImageRef, InputFile, SourceRecord, WorkUnit
from batchvlm.sources.conversations import read_turns, turns_text

KINDS = {"demo": "parquet", "parquet": "parquet", "webdataset": "webdataset", "json": "jsonl", "disk": "hf",
         "imagefolder": "hf", "hub": "hf"}
"""dataset.kind -> the module under batchvlm/sources/ that reads it."""


class Source:
    """A kind of input: list the inputs, plan their units from metadata, read a unit's records."""

    def __init__(self, cfg: DatasetConfig, inputs: list[InputFile] | None = None, max_bytes: int | None = None):
        self.cfg = cfg
        self.max_bytes = max_bytes  # decode.max_bytes: what a stream source does not read into memory at all
        self.inputs = {item.name: item for item in (inputs if inputs is not None else self.list_inputs())}

    def list_inputs(self) -> list[InputFile]:
        raise NotImplementedError

    def plan(self) -> list[WorkUnit]:
        raise NotImplementedError

    def records(self, unit: WorkUnit) -> Iterator[SourceRecord]:
        """The unit's records in input order, each with `seq` (its position in the unit) set."""
        raise NotImplementedError

    def records_at(self, name: str, rows: list[int]) -> Iterator[SourceRecord]:
        """Chosen rows (sorted) of one input, for a requeue; stream sources scan to them."""
        raise NotImplementedError

    def all_ids(self, name: str) -> Iterator[tuple[int, str | None]]:
        """(row, id) of every row of an input: what a requeue scans when a record moved."""
        raise NotImplementedError


def make_source(cfg: DatasetConfig, inputs: list[InputFile] | None = None, max_bytes: int | None = None) -> Source:
    """The source of `dataset.kind`; with `inputs` (a plan's), nothing is listed again."""
    module = importlib.import_module(f"batchvlm.sources.{KINDS[cfg.kind]}")
    return module.SOURCE(cfg, inputs, max_bytes)


# -- files ---------------------------------------------------------------------------------------
def file_system(location: str, storage_options: dict):
    try:
        return fsspec.core.url_to_fs(location, **storage_options)
    except (ImportError, ValueError) as error:  # an unknown protocol, or its package is missing
        raise ConfigError(f"dataset.path={location!r}: {error}") from None


def list_files(paths: str | list[str], suffixes: tuple[str, ...], storage_options: dict) -> list[InputFile]:
    """Files, folders (searched recursively for the suffixes), globs and brace patterns, or a list of them; local or
    any fsspec URL. O(files): a folder is one recursive listing, the paths a brace pattern names one listing of
    each folder they sit in."""
    found: dict[str, dict] = {}
    fs = None
    for pattern in [paths] if isinstance(paths, str) else paths:
        fs, root = file_system(pattern, storage_options)
        found.update(_matches(fs, root, pattern, suffixes))
    found = {path: info for path, info in found.items() if info.get("type") != "directory"}
    if not found:
        raise ConfigError(f"dataset.path={paths!r} matches no {' or '.join(suffixes)} file")
    locations = {path: (path if _is_local(fs) else fs.unstrip_protocol(path)) for path in found}
    common = posixpath.commonpath([posixpath.dirname(path) for path in found])
    return [InputFile(stable_name(path, common), locations[path], found[path].get("size"), file_identity(found[path]))
            for path in sorted(found)]


def _matches(fs, root: str, pattern: str, suffixes: tuple[str, ...]) -> dict[str, dict]:
    if "{" in root:
        return _named(fs, expand_braces(root), pattern)
    if fs.isdir(root):
        return {path: info for path, info in fs.find(root, detail=True).items() if path.endswith(suffixes)}
    return fs.glob(root, detail=True) if fs.exists(root) or glob_pattern(root) else {}


def _named(fs, paths: list[str], pattern: str) -> dict[str, dict]:
    """The listings of the files a brace pattern names, one listing of each folder they sit in; ConfigError naming
    those that are missing."""
    wanted = set(paths)
    found = {}
    for folder in sorted({posixpath.dirname(path) for path in paths}):
        found.update({info["name"]: info for info in fs.ls(folder, detail=True) if info["name"] in wanted})
    if missing := sorted(wanted - found.keys()):
        raise ConfigError(f"dataset.path={pattern!r}: {len(missing)} of the {len(wanted)} files it names do not "
                          f"exist (first: {', '.join(missing[:3])})")
    return found


def expand_braces(pattern: str) -> list[str]:
    """`{00000..00009}` (a numeric range, zero-padded as written) and `{a,b}` (alternatives), as webdataset and
    img2dataset name shard lists, expanded left to right."""
    match = re.search(r"\{([^{}]*)\}", pattern)
    if match is None:
        return [pattern]
    head, body, tail = pattern[:match.start()], match.group(1), pattern[match.end():]
    if numbers := re.fullmatch(r"(\d+)\.\.(\d+)", body):
        low, high = numbers.groups()
        width = len(low) if low.startswith("0") else 0
        choices = [str(value).zfill(width) for value in range(int(low), int(high) + 1)]
    elif "," in body:
        choices = body.split(",")
    else:
        raise ConfigError(f"dataset.path={pattern!r}: {{{body}}} is neither a range (00000..00009) nor a list (a,b)")
    return [path for choice in choices for path in expand_braces(head + choice + tail)]


IDENTITY_KEYS = {"mtime": ("mtime", "LastModified", "last_modified", "updated"), "etag": ("ETag", "etag", "md5Hash"),
                 "version": ("VersionId", "version_id", "generation")}
"""Where fsspec's file systems report when a file changed and which version it is (local, s3, gcs, ...)."""


def file_identity(info: dict) -> dict:
    """The fields of a listing that change when a file is replaced, even by one of the same size."""
    found = {}
    for ours, theirs in IDENTITY_KEYS.items():
        value = next((info[key] for key in theirs if info.get(key) is not None), None)
        if value is not None:
            found[ours] = str(value)
    return found


def glob_pattern(path: str) -> bool:
    return any(char in path for char in "*?[")


def _is_local(fs) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


def stable_name(path: str, root: str) -> str:
    """A name from the path below the inputs' common folder, with a digest that keeps it unique."""
    relative = posixpath.relpath(path, root) if root else posixpath.basename(path)
    relative = re.sub(r"\.(parquet|tar)$", "", relative)
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", relative).strip("_.") or "input"
    return f"{stem}-{hashlib.sha256(relative.encode()).hexdigest()[:8]}"


def open_input(location: str, storage_options: dict, **options):
    """A binary file object for an input, local or remote; `options` go to the file (e.g. block_size)."""
    fs, path = file_system(location, storage_options)
    return fs.open(path, "rb", **options)


# -- column types ----------------------------------------------------------------------------------------
def _texts(kind: pa.DataType) -> bool:
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_null(kind)


def _image(kind: pa.DataType) -> bool:
    """Bytes, a path, or an HF Image struct of them."""
    if pa.types.is_struct(kind):
        return any(kind.field(i).name in ("bytes", "path") for i in range(kind.num_fields))
    return pa.types.is_binary(kind) or pa.types.is_large_binary(kind) or _texts(kind)


def _images(kind: pa.DataType) -> bool:
    """One image, or a list of them."""
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return _image(kind.value_type)
    return _image(kind)


def _turns(kind: pa.DataType) -> bool:
    """A list of turn structs, or the list as a JSON string."""
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return pa.types.is_struct(kind.value_type)
    return _texts(kind)


COLUMN_TYPES = {"id_column": (lambda kind: _texts(kind) or pa.types.is_integer(kind), "a string or an integer"),
                "text_column": (_texts, "a string"), "status_column": (_texts, "a string"),
                "images_column": (_images, "image bytes, a path or an HF Image struct, or a list of them")}
"""What each column the config names may hold: a value of any other type would mean something else or nothing."""
TURNS_COLUMN = (_turns, "a list of turns (structs) or a JSON string of one")
"""The text column of a conversation format (dataset.format other than text)."""


def check_column_types(schema: pa.Schema, cfg: DatasetConfig, where: str) -> None:
    """The columns the config names are of a type batchvlm reads as the config means them (ConfigError naming the
    key, the column and its type, before any row is read)."""
    kinds = COLUMN_TYPES if cfg.format == "text" else {**COLUMN_TYPES, "text_column": TURNS_COLUMN}
    for key, (accepts, wanted) in kinds.items():
        column = getattr(cfg, key)
        if column is not None and column in schema.names and not accepts(schema.field(column).type):
            raise ConfigError(f"dataset.{key}={column!r} is of type {schema.field(column).type} in {where}; "
                              f"it must hold {wanted}")


# -- rows to records -------------------------------------------------------------------------------
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


def parent_of(location: str) -> str:
    return location.rsplit("/", 1)[0] if "://" in location else os.path.dirname(os.path.abspath(location))
