"""The sink on its own: units committed once, in input order, a row group at a time, no empty shard files, files of
a bounded size."""

from __future__ import annotations

import json
import random

import pyarrow.parquet as pq
import rows

from batchvlm.records import OutputRow, SourceRecord, WorkUnit
from batchvlm.rundir.claims import Claims
from batchvlm.rundir.layout import RunLayout
from batchvlm.rundir.manifest import listed_shards, read_manifest
from batchvlm.rundir.sink import ROW_GROUP_ROWS, RunSink

UNIT = WorkUnit("input-00000000-00000004", "input", 0, 4)
NO_EVENTS = {"fallbacks": {}, "parity": {"checked_images": 0, "failed_images": 0}}


def data_row(row: int) -> dict:
    return rows.data_row(id=f"r{row}", source="input.parquet", row=row, text="t", input_ids=[1, 2],
                         token_tags=[0, 0], num_tokens=2)


def quarantine_row(row: int) -> dict:
    return rows.quarantine_row(id=f"r{row}", source="input.parquet", row=row, unit=UNIT.unit_id, stage="decode",
                               check="decode.unreadable", message="m", expected="e", observed="o",
                               exception_type="CheckFailed", image_index=0, image_bytes=[None], image_paths=[None],
                               text="t", fingerprint="f")


def sink_with_claim(run_dir, owner: str):
    claims = Claims(run_dir / "claims", owner, lease_s=60)
    return RunSink(RunLayout(run_dir), {"batchvlm.family": "test"}, "zstd", claims, dedup_buckets=1), claims


def row_of(unit: WorkUnit, row: int, kind: str, values: dict) -> OutputRow:
    """A record's row at its place in the unit (its input row minus the unit's first)."""
    source = SourceRecord(values["id"], unit.unit_id, "input.parquet", row, "t", [], seq=row - unit.start)
    return OutputRow(source, kind, values, NO_EVENTS)


def fill(sink: RunSink, unit: WorkUnit, order: list[int], quarantined: set[int] = frozenset()) -> None:
    for row in order:
        kind, make = ("quarantine", quarantine_row) if row in quarantined else ("data", data_row)
        sink.add(row_of(unit, row, kind, make(row)))
    sink.end_unit(unit, len(order))


def manifest_of(sink: RunSink, unit: WorkUnit) -> dict:
    return json.loads(sink.layout.manifest(unit.unit_id).read_text())


def test_rows_arriving_out_of_order_are_written_in_unit_order(tmp_path):
    sink, claims = sink_with_claim(tmp_path, "rank00000-a")
    sink.start_unit(UNIT, claims.try_claim(UNIT.unit_id))
    fill(sink, UNIT, [2, 0, 3, 1], quarantined={3})
    manifest = manifest_of(sink, UNIT)
    assert pq.read_table(tmp_path / manifest["files"]["data"][0]["path"], columns=["row"]).column("row").to_pylist() \
        == [0, 1, 2]
    assert (manifest["written"], manifest["quarantined"], manifest["checks"]) == (3, 1, {"decode.unreadable": 1})


def test_a_unit_without_quarantined_records_writes_no_quarantine_file(tmp_path):
    sink, claims = sink_with_claim(tmp_path, "rank00000-a")
    sink.start_unit(UNIT, claims.try_claim(UNIT.unit_id))
    fill(sink, UNIT, [0, 1, 2, 3])
    manifest = manifest_of(sink, UNIT)
    assert sorted(manifest["files"]) == ["data", "ids"]
    assert list((tmp_path / "quarantine").iterdir()) == []


def test_a_large_unit_reaches_disk_a_row_group_at_a_time(tmp_path):
    unit = WorkUnit("big-00000000-00001000", "big", 0, 1000)
    sink, claims = sink_with_claim(tmp_path, "rank00000-a")
    sink.start_unit(unit, claims.try_claim(unit.unit_id))
    for row in range(ROW_GROUP_ROWS + 1):
        sink.add(row_of(unit, row, "data", data_row(row)))
    assert len(sink.open[unit.unit_id].shards["data"].buffer) == 1  # the first row group is already written
    for row in range(ROW_GROUP_ROWS + 1, 1000):
        sink.add(row_of(unit, row, "data", data_row(row)))
    sink.end_unit(unit, 1000)
    manifest = manifest_of(sink, unit)
    assert pq.ParquetFile(tmp_path / manifest["files"]["data"][0]["path"]).num_row_groups == -(-1000 // ROW_GROUP_ROWS)


def test_a_holder_whose_unit_was_taken_over_does_not_commit_it(tmp_path):
    first, first_claims = sink_with_claim(tmp_path, "rank00000-slow")
    second, second_claims = sink_with_claim(tmp_path, "rank00001-fast")
    first.start_unit(UNIT, first_claims.try_claim(UNIT.unit_id))
    second_claims.lease_s = -1  # the slow holder's heartbeat counts as expired: the unit is taken over
    taken = second_claims.try_claim(UNIT.unit_id)
    second.start_unit(UNIT, taken)
    fill(second, UNIT, [0, 1, 2, 3])
    fill(first, UNIT, [0, 1, 2, 3])
    assert first.lost == [UNIT.unit_id] and second.lost == []
    manifest = manifest_of(second, UNIT)
    assert manifest["claim"] == taken.token
    files = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.glob("*/*.parquet"))
    # nothing of the loser is left
    assert files == sorted(entry["path"] for entries in manifest["files"].values() for entry in entries)


def test_of_two_commits_of_one_unit_only_the_first_lands(tmp_path):
    (first, first_claims), (second, second_claims) = (sink_with_claim(tmp_path, f"rank0000{i}-x{i}") for i in (0, 1))
    # each holds a claim on a task of its own: the exclusive manifest is the last line of defence
    first.start_unit(UNIT, first_claims.try_claim("u0"))
    second.start_unit(UNIT, second_claims.try_claim("u1"))
    fill(first, UNIT, [0, 1, 2, 3])
    fill(second, UNIT, [0, 1, 2, 3], quarantined={0})
    manifest = manifest_of(first, UNIT)
    assert second.lost == [UNIT.unit_id] and manifest["written"] == 4
    files = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.glob("*/*.parquet"))
    assert files == sorted(entry["path"] for entries in manifest["files"].values() for entry in entries)


def embedded_row(row: int) -> dict:
    """A data row with 8 kB of embeddings that do not compress."""
    return {**data_row(row), "image_embeds": random.Random(row).randbytes(8192)}


def test_a_units_rows_are_cut_into_files_of_at_most_shard_bytes_all_listed_in_row_order(tmp_path):
    unit = WorkUnit("big-00000000-00000100", "big", 0, 100)
    claims = Claims(tmp_path / "claims", "rank00000-a", lease_s=60)
    sink = RunSink(RunLayout(tmp_path), {"batchvlm.family": "test"}, "zstd", claims, dedup_buckets=1,
                   shard_bytes=64 * 1024)
    sink.start_unit(unit, claims.try_claim(unit.unit_id))
    for row in range(100):
        sink.add(row_of(unit, row, "data", embedded_row(row)))
    sink.end_unit(unit, 100)
    manifest = read_manifest(RunLayout(tmp_path).manifest(unit.unit_id))
    files = manifest.shards("data")
    assert len(files) >= 800 // 64 and sum(listing.rows for listing in files) == 100  # 800 kB of rows, 64 kB a file
    rows = []
    for listing in files:
        assert listing.bytes == (tmp_path / listing.path).stat().st_size <= 64 * 1024
        assert pq.read_metadata(tmp_path / listing.path).num_row_groups > 1  # a file is a few row groups
        rows += pq.read_table(tmp_path / listing.path, columns=["row"]).column("row").to_pylist()
    assert rows == list(range(100))
    assert [path for _, path in listed_shards(RunLayout(tmp_path))] == [tmp_path / f.path for f in files]
    assert {RunLayout(tmp_path).claim_of(tmp_path / f.path) for f in files} == {(unit.unit_id, "a0")}
