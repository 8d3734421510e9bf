"""Input files: listed from files, folders, globs and brace patterns, local or any fsspec URL, each with the
identity a resume compares; opened for reading."""

from __future__ import annotations

import hashlib
import os
import posixpath
import re
from collections.abc import Sequence

import fsspec

from batchvlm.config import ConfigError
from batchvlm.records import InputFile
from batchvlm.rundir.patterns import BracePattern, PatternInputs, name_stem


def file_system(location: str, storage_options: dict):
    try:
        return fsspec.core.url_to_fs(location, **storage_options)
    except (ImportError, ValueError) as error:  # an unknown protocol, or its package is missing
        raise ConfigError(f"dataset.path={location!r}: {error}") from None


LISTED_NAMES = 100_000
"""A brace pattern of up to this many names is listed at planning as a folder is: a missing file is refused before any
work, the files' sizes order the claims, and a resume checks each file's identity. A larger one is not listed at all
(rundir.patterns): one unit per name, computed when it is claimed; a missing file is quarantined as its unit is read."""


def list_files(paths: str | list[str], suffixes: tuple[str, ...],
               storage_options: dict) -> list[InputFile] | PatternInputs:
    """Files, folders (searched recursively for the suffixes), globs and brace patterns, or a list of them; local or
    any fsspec URL. O(files): a folder is one recursive listing, the paths a brace pattern names one listing of
    each folder they sit in; a brace pattern of more than LISTED_NAMES names costs one look at its first file."""
    if isinstance(paths, str) and "{" in paths:
        fs, root = file_system(paths, storage_options)
        if len(names := expand_braces(root)) > LISTED_NAMES:
            return _pattern_inputs(fs, root, names, paths)
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


def _pattern_inputs(fs, root: str, names: BracePattern, pattern: str) -> PatternInputs:
    """The inputs of a pattern too large to list; its first file is looked at (a pattern that names nothing that
    exists is refused before any work), and its size is what each unit is planned to hold."""
    try:
        size = fs.size(names[0])
    except FileNotFoundError:
        raise ConfigError(f"dataset.path={pattern!r}: its first file {names[0]} does not exist (a pattern of over "
                          f"{LISTED_NAMES:,} names is not listed: its other files are looked for as they are read)"
                          ) from None
    return PatternInputs(root if _is_local(fs) else fs.unstrip_protocol(root), size or 0)


def _named(fs, paths: Sequence[str], pattern: str) -> dict[str, dict]:
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


def expand_braces(pattern: str) -> BracePattern:
    """`{00000..00009}` (a numeric range, zero-padded as written) and `{a,b}` (alternatives), as webdataset and
    img2dataset name shard lists, expanded left to right: a sequence each name of which is computed when asked for
    (rundir.patterns), so a pattern of 10^9 names costs what its text does."""
    return BracePattern(pattern)


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
    digest = hashlib.sha256(re.sub(r"\.(parquet|tar)$", "", relative).encode()).hexdigest()[:8]
    return f"{name_stem(relative)}-{digest}"


def open_input(location: str, storage_options: dict, **options):
    """A binary file object for an input, local or remote; `options` go to the file (e.g. block_size)."""
    fs, path = file_system(location, storage_options)
    return fs.open(path, "rb", **options)


def parent_of(location: str) -> str:
    return location.rsplit("/", 1)[0] if "://" in location else os.path.dirname(os.path.abspath(location))
