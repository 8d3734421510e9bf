"""Duplicate ids across a run, found without holding the run's ids anywhere.

Each unit commits, beside its shards, an ids file: (id, row, kind) of every record, sorted by the
hash partition (bucket) of the id, one row group per bucket, the bucket -> row group map in the
manifest. As the tail sees each unit committed, it gathers that map (`IdsGather`), and once every
unit is, writes them all, in plan order, to one index (`dedup/index.parquet`): no rank reads the
manifests for the duplicate pass. Ranks then claim buckets (rundir.frontier); a bucket reads its row
group of every ids file that has one, in plan order, and lists every occurrence of an id after its
first (plan order of the units, then row): `dedup/<bucket>.parquet`, with `dedup/<bucket>.json` as
the bucket's commit. Memory is one bucket's ids; the ids are read once in all.

Later occurrences stay in their shards (a committed shard is never rewritten): the reader, verify,
the report and the run's totals read the lists and set them aside under source.duplicate_id.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from batchvlm.rundir.claims import Claim, Claims
from batchvlm.rundir.durable import durable_write, durable_write_json, read_json
from batchvlm.rundir.layout import DATA, IDS, QUARANTINE, RunLayout
from batchvlm.rundir.manifest import Manifest, read_manifest

IDS_SCHEMA = pa.schema([("bucket", pa.int32()), ("id", pa.string()), ("row", pa.int64()), ("kind", pa.string())])
INDEX_SCHEMA = pa.schema([("unit", pa.string()), ("source", pa.string()), ("path", pa.string()),
                          ("buckets", pa.list_(pa.int32())), ("row_groups", pa.list_(pa.int32()))])
DUPLICATES_SCHEMA = pa.schema([("id", pa.string()), ("unit", pa.string()), ("source", pa.string()),
                               ("row", pa.int64()), ("kind", pa.string()), ("first_unit", pa.string()),
                               ("first_row", pa.int64())])


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


@dataclass(frozen=True)
class UnitIds:
    """A committed unit's ids file, as the duplicate pass reads it: where it is, and the row group of each bucket."""

    unit: str
    source: str
    path: str  # as a manifest names it
    buckets: dict[int, int]

    @classmethod
    def of(cls, manifest: Manifest) -> UnitIds:
        ids = manifest.shards(IDS)[0]  # one ids file per unit
        return cls(manifest.unit, manifest.source, ids.path, {int(b): group for b, group in ids.buckets.items()})


class IdsGather:
    """The tail's record of committed units (rundir.frontier): each unit's manifest read once, when it is first seen
    committed, and its ids file kept for the index."""

    def __init__(self, layout: RunLayout, unit_ids: list[str]):
        self.layout, self.unit_ids = layout, unit_ids  # in plan order
        self.found: dict[str, UnitIds] = {}

    def committed(self, unit_id: str) -> bool:
        try:
            manifest = read_manifest(self.layout.manifest(unit_id))
        except FileNotFoundError:
            return False
        self.found[unit_id] = UnitIds.of(manifest)
        return True

    def write_index(self) -> None:
        """Every unit's ids file, in plan order: what the duplicate pass reads instead of the manifests."""
        units = [self.found[unit_id] for unit_id in self.unit_ids]
        table = pa.table({"unit": [u.unit for u in units], "source": [u.source for u in units],
                          "path": [u.path for u in units], "buckets": [list(u.buckets) for u in units],
                          "row_groups": [list(u.buckets.values()) for u in units]}, schema=INDEX_SCHEMA)
        self.layout.dedup.mkdir(exist_ok=True)
        durable_write(self.layout.dedup_index, lambda tmp: pq.write_table(table, tmp))


def read_index(layout: RunLayout) -> list[UnitIds]:
    return [UnitIds(row["unit"], row["source"], row["path"], dict(zip(row["buckets"], row["row_groups"])))
            for row in pq.read_table(layout.dedup_index).to_pylist()]


def find_duplicates(layout: RunLayout, units: Iterable[UnitIds], bucket: int,
                    locations: dict[str, str]) -> list[dict]:
    """Every occurrence of an id of this bucket after its first; `units` in plan order."""
    first: dict[str, tuple[str, int]] = {}
    duplicates = []
    for ids in units:
        group = ids.buckets.get(bucket)
        if group is None:
            continue
        table = pq.ParquetFile(layout.listed(ids.path)).read_row_group(group, columns=["id", "row", "kind"])
        for record_id, row, kind in sorted(zip(*(table.column(c).to_pylist() for c in ("id", "row", "kind"))),
                                           key=lambda r: r[1]):
            if record_id in first:
                duplicates.append({"id": record_id, "unit": ids.unit, "source": locations[ids.source],
                                   "row": row, "kind": kind, "first_unit": first[record_id][0],
                                   "first_row": first[record_id][1]})
            else:
                first[record_id] = (ids.unit, row)
    return duplicates


def bucket_task(bucket: int) -> str:
    """The name a bucket is claimed under."""
    return f"dedup-{bucket:05d}"


def bucket_of_task(task: str) -> int:
    return int(task.rsplit("-", 1)[1])


class BucketPass:
    """One rank's work on the buckets it claims: the later occurrences of each bucket's ids, from the index's ids
    files (read once, at the first bucket), committed if the rank still holds the bucket."""

    def __init__(self, layout: RunLayout, locations: dict[str, str], claims: Claims):
        self.layout, self.locations, self.claims = layout, locations, claims
        self.index: list[UnitIds] | None = None

    def __call__(self, claimed: Iterable[Claim]) -> None:
        for claim in claimed:
            if self.index is None:
                self.index = read_index(self.layout)
            bucket = bucket_of_task(claim.task)
            duplicates = find_duplicates(self.layout, self.index, bucket, self.locations)
            if self.claims.holds(claim):
                commit_bucket(self.layout, bucket, duplicates)


def commit_bucket(layout: RunLayout, bucket: int, duplicates: list[dict]) -> None:
    """The bucket's list (a Parquet file, only when it has rows), then its JSON, which is the commit."""
    layout.dedup.mkdir(exist_ok=True)
    listed = None
    if duplicates:
        path = layout.bucket_duplicates(bucket)
        table = pa.Table.from_pylist(duplicates, schema=DUPLICATES_SCHEMA)
        durable_write(path, lambda tmp: pq.write_table(table, tmp))
        listed = path.name
    counts = Counter(d["kind"] for d in duplicates)
    durable_write_json(layout.bucket_result(bucket), {"bucket": bucket, "duplicates": len(duplicates),
                                                      "in_data": counts[DATA], "in_quarantine": counts[QUARANTINE],
                                                      "file": listed})


def bucket_results(layout: RunLayout, buckets: int) -> list[dict | None]:
    """Each bucket's commit, None where the duplicate pass has not committed it (yet)."""
    return [read_json(layout.bucket_result(bucket)) for bucket in range(buckets)]


def committed_results(layout: RunLayout) -> list[dict]:
    """The commits of the buckets done so far."""
    return [read_json(path) for path in layout.committed_buckets()]


def duplicate_rows(layout: RunLayout) -> Iterator[dict]:
    """Every listed later occurrence of an id, from the buckets committed so far."""
    for result in committed_results(layout):
        if result["file"]:
            yield from pq.read_table(layout.bucket_duplicates(result["bucket"])).to_pylist()


def excluded_rows(layout: RunLayout) -> dict[str, set[int]]:
    """unit -> rows of its data shard that are later occurrences of an id: readers skip them."""
    excluded: dict[str, set[int]] = {}
    for duplicate in duplicate_rows(layout):
        if duplicate["kind"] == DATA:
            excluded.setdefault(duplicate["unit"], set()).add(duplicate["row"])
    return excluded
