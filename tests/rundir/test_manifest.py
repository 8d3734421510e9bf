"""Manifests: read in one place, refused with the file's name when they are not one; what no manifest lists; the
run's totals with the later occurrences of an id moved to the quarantined."""

from __future__ import annotations

import json

import pytest

from batchvlm.rundir.layout import DATA, IDS, QUARANTINE, RunLayout
from batchvlm.rundir.manifest import (Listing, Manifest, ManifestError, RunTotals, all_manifests, listed_shards,
                                      orphans, read_manifest)


def manifest(unit: str, written: int, quarantined: int, checks: dict | None = None) -> Manifest:
    files = {DATA: [Listing(f"data/{unit}.a0.parquet", written, 10, "d")],
             IDS: [Listing(f"ids/{unit}.a0.parquet", written + quarantined, 10, "i", buckets={"0": 0})]}
    if quarantined:
        files[QUARANTINE] = [Listing(f"quarantine/{unit}.a0.parquet", quarantined, 10, "q")]
    return Manifest(unit, "input", 0, written + quarantined, written + quarantined, written, quarantined,
                    checks or {}, files, rank=0, claim="a0")


def commit(layout: RunLayout, committed: Manifest) -> None:
    for folder in layout.unit_folders():
        folder.mkdir(parents=True, exist_ok=True)
    for listing in committed.listings():
        layout.listed(listing.path).write_bytes(b"parquet")
    layout.manifest(committed.unit).write_text(json.dumps(committed.to_json()))


def test_a_manifest_reads_back_as_it_was_written(tmp_path):
    layout = RunLayout(tmp_path)
    commit(layout, written := manifest("u", 3, 1, {"decode.truncated": 1}))
    assert read_manifest(layout.manifest("u")) == written
    assert listed_shards(layout, QUARANTINE) == [("u", tmp_path / "quarantine/u.a0.parquet")]


@pytest.mark.parametrize("text", ["{}", "[1, 2]", '{"unit": "u"}', "not json"])
def test_a_file_that_is_no_manifest_is_refused_naming_it(tmp_path, text):
    layout = RunLayout(tmp_path)
    layout.manifests.mkdir()
    layout.manifest("u").write_text(text)
    with pytest.raises(ManifestError, match=r"manifest/u\.json"):
        all_manifests(layout)


def test_orphans_are_temporary_files_and_shards_no_manifest_lists(tmp_path):
    layout = RunLayout(tmp_path)
    commit(layout, manifest("u", 2, 0))
    unlisted = layout.shard(DATA, "v", "b0")
    temporary = tmp_path / "manifest" / ".v.json.tmp-123"
    elsewhere = tmp_path / "dedup" / "00000.json"
    for path in (unlisted, temporary, elsewhere):
        path.parent.mkdir(exist_ok=True)
        path.write_text("x")
    assert sorted(orphans(layout, all_manifests(layout))) == sorted([unlisted, temporary])


def test_totals_move_the_later_occurrences_in_data_to_the_quarantined():
    manifests = [manifest("a", 4, 1, {"decode.truncated": 1}), manifest("b", 5, 0)]
    buckets = [{"duplicates": 3, "in_data": 2, "in_quarantine": 1}, {"duplicates": 0, "in_data": 0}]
    totals = RunTotals.of(manifests, buckets)
    assert (totals.records_in, totals.written, totals.quarantined) == (10, 7, 3)
    assert totals.by_check == {"decode.truncated": 1, "source.duplicate_id": 2}
    assert (totals.later_occurrences, totals.duplicates_in_data, totals.units_committed) == (3, 2, 2)
    assert totals.records_in == totals.written + totals.quarantined
