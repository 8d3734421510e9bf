"""Cleanup deletes only what batchvlm wrote for this run, and only what dead claims left; a unit whose files are not
whole loses its commit."""

from __future__ import annotations

import json
import time

from test_claims import Clock

from batchvlm.rundir.claims import Claims
from batchvlm.rundir.cleanup import stale_files, uncommit_broken
from batchvlm.rundir.durable import temporary_name
from batchvlm.rundir.layout import DATA, IDS, QUARANTINE, RunLayout
from batchvlm.rundir.manifest import Listing, Manifest

UNITS = {"a-00000000-00000004": "a-00000000-00000004", "b-00000000-00000004": "b-00000000-00000004"}
"""The plan's units, each claimed under its own name (blocks of one unit)."""


def layout_of(tmp_path) -> RunLayout:
    layout = RunLayout(tmp_path)
    for folder in layout.unit_folders():
        folder.mkdir(parents=True, exist_ok=True)
    return layout


def written(layout: RunLayout, kind: str, unit: str, token: str, data: bytes = b"rows") -> object:
    path = layout.shard(kind, unit, token)
    path.write_bytes(data)
    return path


def test_files_batchvlm_does_not_name_for_this_run_are_never_touched(tmp_path):
    layout = layout_of(tmp_path)
    clock = Clock(time.time())
    claims = Claims(layout.claims, "x-rank00000-host-1-deadbeef", lease_s=0.01, clock=clock)
    foreign = [layout.folder(DATA) / "train.parquet", layout.folder(IDS) / "ids.csv",
               layout.shard(DATA, "not-in-the-plan", "deadbeef0")]
    for path in foreign:
        path.write_text("a user's file")
    clock.now += 0.05
    assert stale_files(layout, UNITS, claims) == []


def test_a_live_holders_files_stay_and_a_dead_fenced_claims_files_go(tmp_path):
    layout = layout_of(tmp_path)
    clock = Clock(time.time())
    holder = Claims(layout.claims, "first-rank00000-host-1-aaaaaaaa", lease_s=0.5, clock=clock)
    claim = holder.try_claim("a-00000000-00000004")
    shard = written(layout, DATA, claim.task, claim.token)
    draft = temporary_name(layout.manifest_draft(claim.task, claim.token))
    draft.write_text("{}")
    other = Claims(layout.claims, "second-rank00000-host-2-bbbbbbbb", lease_s=0.5, clock=clock)
    assert stale_files(layout, UNITS, other) == []  # a holder between its shards and its manifest: alive
    clock.now += 0.7
    assert stale_files(layout, UNITS, other) == []  # its lease expired, but nobody took the unit over: it may wake
    taken = other.try_claim(claim.task)
    assert taken is not None and taken.generation == 1
    assert sorted(stale_files(layout, UNITS, other)) == sorted([shard, draft])  # fenced and expired: dead


def test_a_unit_committed_by_another_claim_leaves_the_losers_files_stale_once_the_loser_is_dead(tmp_path):
    layout = layout_of(tmp_path)
    clock = Clock(time.time())
    loser = Claims(layout.claims, "first-rank00000-host-1-aaaaaaaa", lease_s=0.3, clock=clock)
    claim = loser.try_claim("b-00000000-00000004")
    leftover = written(layout, QUARANTINE, claim.task, claim.token)
    winner_file = written(layout, DATA, claim.task, "cccccccc1")
    ids_file = written(layout, IDS, claim.task, "cccccccc1")
    manifest = Manifest(claim.task, "b", 0, 4, 4, 4, 0, {}, {
        DATA: [Listing(layout.name_of(winner_file), 4, 4, "x")], IDS: [Listing(layout.name_of(ids_file), 4, 4, "y")]},
        rank=1, claim="cccccccc1")
    layout.manifest(claim.task).write_text(json.dumps(manifest.to_json()))
    clock.now += 0.5
    watcher = Claims(layout.claims, "third-rank00000-host-3-dddddddd", lease_s=0.3, clock=clock)
    assert stale_files(layout, UNITS, watcher) == [leftover]


def test_a_unit_whose_files_are_not_whole_loses_its_commit_and_the_duplicate_pass_its_results(tmp_path):
    layout = layout_of(tmp_path)
    data = written(layout, DATA, "a-00000000-00000004", "aaaaaaaa0", b"12345678")
    ids = written(layout, IDS, "a-00000000-00000004", "aaaaaaaa0", b"1234")
    manifest = Manifest("a-00000000-00000004", "a", 0, 4, 4, 4, 0, {}, {
        DATA: [Listing(layout.name_of(data), 4, 8, "x")], IDS: [Listing(layout.name_of(ids), 4, 4, "y")]},
        rank=0, claim="aaaaaaaa0")
    layout.manifest(manifest.unit).write_text(json.dumps(manifest.to_json()))
    layout.manifest("b-00000000-00000004").write_text("{}")  # a manifest that is not one
    layout.dedup.mkdir()
    layout.bucket_result(0).write_text(json.dumps({"bucket": 0, "file": None}))
    assert uncommit_broken(layout) == ["b-00000000-00000004"]  # a is whole
    data.write_bytes(b"1234")  # truncated
    assert uncommit_broken(layout) == ["a-00000000-00000004"]
    assert not layout.manifest(manifest.unit).exists() and not layout.bucket_result(0).exists()
