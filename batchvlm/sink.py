"""Sink: Parquet shards committed atomically per work unit, quarantine shards, manifests, `_SUCCESS`.

A unit commits once every one of its records is either a row or a quarantine row: each file is
written to a temporary name in its final directory, fsynced, renamed, the directory fsynced; the
manifest entry comes last and is the commit. Readers and resume trust only what a manifest lists.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from batchvlm.assemble import DATA_SCHEMA, QUARANTINE_SCHEMA
from batchvlm.faults import crash_point
from batchvlm.preprocess import merged_stats
from batchvlm.records import WorkUnit

TMP_MARK = ".tmp-"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def durable_write(path: Path, write) -> None:
    """Write via `write(tmp_path)` to a temporary name beside `path`, fsync, rename, fsync the directory."""
    tmp = path.with_name(f".{path.name}{TMP_MARK}{os.getpid()}")
    write(tmp)
    crash_point("commit.before_rename")
    with open(tmp, "rb+") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def durable_write_json(path: Path, payload: dict) -> None:
    durable_write(path, lambda tmp: tmp.write_text(json.dumps(payload, indent=2, sort_keys=True)))


def read_json(path: Path) -> dict | None:
    """A JSON file batchvlm wrote durably, or None where it has not been written (yet)."""
    return json.loads(path.read_text()) if path.exists() else None


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclass
class OpenUnit:
    unit: WorkUnit
    rows: list = field(default_factory=list)
    quarantined: list = field(default_factory=list)
    preprocess: list = field(default_factory=list)  # each record's PreprocessGuard.take()
    expected: int | None = None

    @property
    def complete(self) -> bool:
        return self.expected is not None and len(self.rows) + len(self.quarantined) == self.expected


class RunSink:
    """Owns the run directory's data/, quarantine/ and manifest/ folders."""

    def __init__(self, run_dir: Path, metadata: dict[str, str], compression: str, rank: int = 0):
        self.run_dir = run_dir
        self.rank = rank
        self.metadata = {k.encode(): v.encode() for k, v in metadata.items()}
        self.compression = None if compression == "none" else compression
        for name in ("data", "quarantine", "manifest"):
            (run_dir / name).mkdir(parents=True, exist_ok=True)
        self.open: dict[str, OpenUnit] = {}

    # -- state on disk --------------------------------------------------------------------------
    def manifest_path(self, unit_id: str) -> Path:
        return self.run_dir / "manifest" / f"{unit_id}.json"

    def committed(self) -> set[str]:
        return {path.stem for path in (self.run_dir / "manifest").glob("*.json")}

    def remove_orphans(self) -> list[Path]:
        """What a crashed attempt left: temporary files, and shards renamed into place whose manifest
        never landed. No manifest lists them, so no reader trusts them; their units are redone."""
        committed = self.committed()
        orphans = [p for name in ("data", "quarantine", "manifest") for p in (self.run_dir / name).iterdir()
                   if TMP_MARK in p.name or (name != "manifest" and p.stem not in committed)]
        for path in orphans:
            path.unlink(missing_ok=True)
        return orphans

    # -- records --------------------------------------------------------------------------------
    def _unit(self, unit: WorkUnit) -> OpenUnit:
        return self.open.setdefault(unit.unit_id, OpenUnit(unit))

    def add_row(self, unit: WorkUnit, row: dict, preprocess: dict) -> None:
        self._unit(unit).rows.append(row)
        self._unit(unit).preprocess.append(preprocess)
        self._maybe_commit(unit.unit_id)

    def add_quarantine(self, unit: WorkUnit, row: dict, preprocess: dict) -> None:
        self._unit(unit).quarantined.append(row)
        self._unit(unit).preprocess.append(preprocess)
        self._maybe_commit(unit.unit_id)

    def end_unit(self, unit: WorkUnit, num_records: int) -> None:
        self._unit(unit).expected = num_records
        self._maybe_commit(unit.unit_id)

    def _maybe_commit(self, unit_id: str) -> None:
        if self.open[unit_id].complete:
            self.commit(self.open.pop(unit_id))

    def commit(self, state: OpenUnit) -> dict:
        unit = state.unit
        # Rows arrive in batch order; a shard lists them in input order so reruns are byte-identical.
        rows = sorted(state.rows, key=lambda r: r["row"])
        quarantined = sorted(state.quarantined, key=lambda r: r["row"])
        files = {
            "data": self._write_shard("data", unit.unit_id, rows, DATA_SCHEMA),
            "quarantine": self._write_shard("quarantine", unit.unit_id, quarantined, QUARANTINE_SCHEMA),
        }
        crash_point("commit.before_manifest")
        checks = Counter(row["check"] for row in quarantined)
        manifest = {"unit": unit.unit_id, "source": unit.source, "start": unit.start, "stop": unit.stop,
                    "records_in": state.expected, "written": len(rows), "quarantined": len(quarantined),
                    "checks": dict(sorted(checks.items())), **merged_stats(state.preprocess), "files": files,
                    "rank": self.rank}
        durable_write_json(self.manifest_path(unit.unit_id), manifest)
        return manifest

    def _write_shard(self, kind: str, unit_id: str, rows: list[dict], schema: pa.Schema) -> dict:
        path = self.run_dir / kind / f"{unit_id}.parquet"
        table = pa.Table.from_pylist(rows, schema=schema).replace_schema_metadata(self.metadata)
        durable_write(path, lambda tmp: pq.write_table(table, tmp, compression=self.compression))
        return {"path": f"{kind}/{path.name}", "rows": len(rows), "bytes": path.stat().st_size,
                "sha256": sha256_file(path)}


class SinkWriter:
    """Runs the sink on a thread behind a bounded queue, so writing never stalls the device loop."""

    def __init__(self, sink: RunSink, maxsize: int):
        self.sink = sink
        self.queue: queue.Queue = queue.Queue(maxsize=maxsize)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="batchvlm-sink", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (task := self.queue.get()) is not None:
            if self.error is None:
                try:
                    task()
                except BaseException as error:  # surfaced to the main thread on the next submit/close
                    self.error = error

    def submit(self, task) -> None:
        self._raise_if_failed()
        self.queue.put(task)

    def close(self) -> None:
        if self.thread.is_alive():
            self.queue.put(None)
            self.thread.join()
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"the sink failed: {self.error}") from self.error
