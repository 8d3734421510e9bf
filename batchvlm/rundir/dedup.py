"""Duplicate ids across a run, found without holding the run's ids anywhere.

Each unit commits, beside its shards, an ids file: (id, row, kind) of every record, sorted by the
hash partition (bucket) of the id, one row group per bucket, the bucket -> row group map in the
manifest. Once every unit is committed, ranks claim buckets; a bucket reads its row group of every
ids file, in plan order, and lists every occurrence of an id after its first (plan order of the
units, then row): `dedup/<bucket>.parquet`, with `dedup/<bucket>.json` as the bucket's commit.
Memory is one bucket's ids; the ids are read once in all.

Later occurrences stay in their shards (a committed shard is never rewritten): the reader, verify,
the report and `_SUCCESS` read the lists and set them aside under source.duplicate_id.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from batchvlm.rundir.durable import durable_write, durable_write_json, read_json

IDS_SCHEMA = pa.schema([("bucket", pa.int32()), ("id", pa.string()), ("row", pa.int64()), ("kind", pa.string())])
DUPLICATES_SCHEMA = pa.schema([("id", pa.string()), ("unit", pa.string()), ("source", pa.string()),
                               ("row", pa.int64()), ("kind", pa.string()), ("first_unit", pa.string()),
                               ("first_row", pa.int64())])
FOLDER = "dedup"


def bucket_of(record_id: str, buckets: int) -> int:
    """A hash that is the same in every process and release (Python's own hash() is salted)."""
    return int.from_bytes(hashlib.blake2b(record_id.encode(), digest_size=8).digest(), "little") % buckets


def write_ids(path: Path, ids: list[tuple[str, int, str]], buckets: int) -> dict[str, int]:
    """(id, row, kind) of a unit's records, one row group per non-empty bucket; returns bucket -> row group."""
    by_bucket: dict[int, list] = {}
    for record_id, row, kind in ids:
        by_bucket.setdefault(bucket_of(record_id, buckets), []).append((record_id, row, kind))
    groups = {}
    with pq.ParquetWriter(path, IDS_SCHEMA) as writer:
        for index, bucket in enumerate(sorted(by_bucket)):
            rows = by_bucket[bucket]
            writer.write_table(pa.table({"bucket": [bucket] * len(rows), "id": [r[0] for r in rows],
                                         "row": [r[1] for r in rows], "kind": [r[2] for r in rows]},
                                        schema=IDS_SCHEMA))
            groups[str(bucket)] = index
    return groups


def find_duplicates(run_dir: Path, manifests: Iterable[dict], bucket: int, locations: dict[str, str]) -> list[dict]:
    """Every occurrence of an id of this bucket after its first; `manifests` in plan order."""
    first: dict[str, tuple[str, int]] = {}
    duplicates = []
    for manifest in manifests:
        ids = manifest["files"]["ids"]
        group = ids["buckets"].get(str(bucket))
        if group is None:
            continue
        table = pq.ParquetFile(run_dir / ids["path"]).read_row_group(group, columns=["id", "row", "kind"])
        for record_id, row, kind in sorted(zip(*(table.column(c).to_pylist() for c in ("id", "row", "kind"))),
                                           key=lambda r: r[1]):
            if record_id in first:
                duplicates.append({"id": record_id, "unit": manifest["unit"], "source": locations[manifest["source"]],
                                   "row": row, "kind": kind, "first_unit": first[record_id][0],
                                   "first_row": first[record_id][1]})
            else:
                first[record_id] = (manifest["unit"], row)
    return duplicates


def result_path(run_dir: Path, bucket: int) -> Path:
    return run_dir / FOLDER / f"{bucket:05d}.json"


def commit_bucket(run_dir: Path, bucket: int, duplicates: list[dict]) -> None:
    """The bucket's list (a Parquet file, only when it has rows), then its JSON, which is the commit."""
    folder = run_dir / FOLDER
    folder.mkdir(exist_ok=True)
    listed = None
    if duplicates:
        path = folder / f"{bucket:05d}.parquet"
        table = pa.Table.from_pylist(duplicates, schema=DUPLICATES_SCHEMA)
        durable_write(path, lambda tmp: pq.write_table(table, tmp))
        listed = path.name
    counts = Counter(d["kind"] for d in duplicates)
    durable_write_json(result_path(run_dir, bucket), {"bucket": bucket, "duplicates": len(duplicates),
                                                      "in_data": counts["data"], "in_quarantine": counts["quarantine"],
                                                      "file": listed})


def bucket_results(run_dir: Path, buckets: int) -> list[dict | None]:
    return [read_json(result_path(run_dir, bucket)) for bucket in range(buckets)]


def duplicate_rows(run_dir: Path) -> Iterator[dict]:
    """Every listed later occurrence of an id, from the committed buckets."""
    for result in sorted((run_dir / FOLDER).glob("*.json")) if (run_dir / FOLDER).is_dir() else []:
        listed = json.loads(result.read_text())["file"]
        if listed:
            yield from pq.read_table(run_dir / FOLDER / listed).to_pylist()


def excluded_rows(run_dir: Path) -> dict[str, set[int]]:
    """unit -> rows of its data shard that are later occurrences of an id: readers skip them."""
    excluded: dict[str, set[int]] = {}
    for duplicate in duplicate_rows(run_dir):
        if duplicate["kind"] == "data":
            excluded.setdefault(duplicate["unit"], set()).add(duplicate["row"])
    return excluded
