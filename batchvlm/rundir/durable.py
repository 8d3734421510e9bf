"""The local durable write primitive (write beside, fsync, rename, fsync the directory), and its exclusive
variant for commits that only one writer may make."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path

from batchvlm.config import ConfigError
from batchvlm.faults import crash_point, disk_full_point

TMP_MARK = ".tmp-"


class DamagedMetadata(ConfigError):
    """A file of a run directory that batchvlm did not write, or that is damaged (truncated, overwritten): the message
    names it and what is wrong, for a job, a status or a verify to say instead of a traceback."""

    @classmethod
    def of(cls, path: Path, what: str, error: Exception) -> DamagedMetadata:
        return cls(f"{path} is not {what} ({type(error).__name__}: {error}): batchvlm did not write it, or it is "
                   "damaged")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temporary_name(path: Path) -> Path:
    """A name beside `path` that readers and resume recognise as not committed."""
    return path.with_name(f".{path.name}{TMP_MARK}{os.getpid()}")


def fsync_file(path: Path) -> None:
    with open(path, "rb+") as handle:
        os.fsync(handle.fileno())


def publish(tmp: Path, path: Path) -> None:
    """fsync a finished temporary file, rename it to its final name, fsync the directory."""
    disk_full_point("publish", path)
    fsync_file(tmp)
    crash_point("commit.before_rename")
    os.replace(tmp, path)
    fsync_dir(path.parent)


def publish_exclusive(tmp: Path, path: Path) -> bool:
    """Like `publish`, but only if `path` does not exist yet (a hard link fails where a rename would
    replace): of two writers of one commit, exactly one wins. False for the loser, whose file is removed."""
    fsync_file(tmp)
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    finally:
        tmp.unlink()
    fsync_dir(path.parent)
    return True


def durable_write(path: Path, write) -> None:
    """Write via `write(tmp_path)` to a temporary name beside `path`, then `publish` it."""
    tmp = temporary_name(path)
    write(tmp)
    publish(tmp, path)


def json_text(payload: dict) -> str:
    return json.dumps(payload, indent=2, sort_keys=True)


def durable_write_json(path: Path, payload: dict) -> None:
    durable_write(path, lambda tmp: tmp.write_text(json_text(payload)))


def replace_json(path: Path, payload: dict) -> None:
    """Written beside and renamed over `path`, not fsynced: for a file rewritten often that a crash may lose (a
    reader sees the old or the new one, never half of it)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, path)


def read_json(path: Path) -> dict | None:
    """A JSON object batchvlm wrote durably, or None where it has not been written (yet); DamagedMetadata where the
    file holds no JSON object."""
    try:
        found = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError
        raise DamagedMetadata.of(path, "a JSON file", error) from None
    if not isinstance(found, dict):
        raise DamagedMetadata.of(path, "a JSON object", TypeError(f"it holds a {type(found).__name__}"))
    return found


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
