"""Input files: listed from files, folders, globs and brace patterns, local or any fsspec URL, each with the
identity a resume compares; opened for reading."""

from __future__ import annotations

import hashlib
import os
import posixpath
import re

import fsspec

from batchvlm.config import ConfigError
from batchvlm.records import InputFile


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


def parent_of(location: str) -> str:
    return location.rsplit("/", 1)[0] if "://" in location else os.path.dirname(os.path.abspath(location))
