"""Runs of the older format: refused by every reader naming the upgrade, upgraded into the run they were, an upgrade
stopped part way finished when run again."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from batchvlm.executor.config import JobConfig
from batchvlm.executor.job import run_job
from batchvlm.format.schema import DATA_SCHEMA, FORMAT_KEY, FORMAT_VERSION, QUARANTINE_SCHEMA, FormatError
from batchvlm.review.report import build_report
from batchvlm.rundir.durable import sha256_file
from batchvlm.rundir.layout import DATA, QUARANTINE, RunLayout
from batchvlm.rundir.manifest import all_manifests, read_manifest
from batchvlm.rundir.upgrade import SHARDS, _rewrite, run_format, upgrade_run
from batchvlm.rundir.verify import verify_run
from batchvlm.rundir.workunits import read_plan
from batchvlm.training.interop import load_run_dataset
from batchvlm.training.loader import RunIndex
from batchvlm.training.reader import read_run

# runs of the job, upgraded as a process
pytestmark = pytest.mark.slow


OLDER_DATA = ("num_tokens", "loss_mask", "turns", "dropped_turns")
"""The data columns the job added after it first wrote shards; a quarantine shard's are turns and turn_index."""


def as_format_1(run: Path, to: Path, marker: bool) -> Path:
    """A copy of a run as the job wrote it before the output format had a version: no version anywhere (and no marker
    at all, where `marker` is false), a plan without blocks, one file per kind in each manifest, shards without the
    columns added since, position_ids a fixed-size list of three lists, and no `datasets` key."""
    shutil.copytree(run, to)
    layout = RunLayout(to)
    if marker:
        layout.marker.write_text(json.dumps({"batchvlm": "0.1.0", "run": to.name}))
    else:
        layout.marker.unlink()
    plan = json.loads(layout.plan.read_text())
    del plan["block_units"]
    layout.plan.write_text(json.dumps(plan))
    for manifest in all_manifests(layout):
        files = {}
        for kind, listings in manifest.files.items():
            assert len(listings) == 1  # a unit wrote one file of a kind then
            (listing,) = listings
            path = layout.listed(listing.path)
            if kind in (DATA, QUARANTINE):
                _write_format_1(path, kind)
            files[kind] = {**dataclasses.asdict(listing), "bytes": path.stat().st_size, "sha256": sha256_file(path)}
        layout.manifest(manifest.unit).write_text(json.dumps({**manifest.to_json(), "files": files}))
    success = json.loads(layout.success.read_text())
    success.pop("format_version")
    layout.success.write_text(json.dumps(success))
    return to


def _write_format_1(path: Path, kind: str) -> None:
    table = pq.read_table(path)
    dropped = OLDER_DATA if kind == DATA else ("turns", "turn_index")
    table = table.drop_columns(list(dropped))
    if kind == DATA:
        index = table.column_names.index("position_ids")
        table = table.set_column(index, "position_ids",
                                 table.column("position_ids").cast(pa.list_(pa.list_(pa.int32()), 3)))
    metadata = {key: value for key, value in table.schema.metadata.items()
                if key not in (b"huggingface", FORMAT_KEY.encode())}
    pq.write_table(table.replace_schema_metadata(metadata), path)


@pytest.fixture(scope="module")
def older_run(qwen_run, tmp_path_factory) -> Path:
    return as_format_1(qwen_run, tmp_path_factory.mktemp("older") / "qwen", marker=True)


def test_every_reader_refuses_a_run_of_the_older_format_naming_the_upgrade(older_run, tmp_path):
    upgrade = "upgrade the run directory once with `batchvlm-upgrade run_dir=<run>`"
    for read in (lambda: list(read_run(older_run)), lambda: load_run_dataset(older_run),
                 lambda: build_report(older_run, thumbnails=False),
                 lambda: run_job(JobConfig(run_name=older_run.name), older_run)):
        with pytest.raises(FormatError, match=rf"written in output format 1; .*{upgrade}"):
            read()
    assert verify_run(older_run)[0].endswith(upgrade)


@pytest.mark.parametrize("marker", [True, False], ids=["with-marker", "before-the-marker"])
def test_an_upgraded_run_reads_as_the_run_it_was(qwen_run, tmp_path, marker):
    older = as_format_1(qwen_run, tmp_path / "qwen", marker)
    assert run_format(RunLayout(older)) == 1
    done = upgrade_run(older)
    assert (done.found, done.shards) == (1, len(all_manifests(RunLayout(older))) * 2 - _units_without(qwen_run))
    layout = RunLayout(older)
    assert run_format(layout) == FORMAT_VERSION and verify_run(older) == []
    assert read_plan(layout).block_units == 1  # a plan made before blocks claims one unit per block
    assert [m.files for m in all_manifests(layout)] != [] and all(
        isinstance(listings, list) for m in all_manifests(layout) for listings in m.files.values())
    for kind, schema in ((DATA, DATA_SCHEMA), (QUARANTINE, QUARANTINE_SCHEMA)):
        for manifest in all_manifests(layout):
            for listing in manifest.shards(kind):
                written = pq.read_schema(layout.listed(listing.path))
                assert written.remove_metadata() == schema and written.metadata[FORMAT_KEY.encode()] == str(FORMAT_VERSION).encode()
    before, after = list(read_run(qwen_run)), list(read_run(older))
    assert [r.id for r in after] == [r.id for r in before]
    for old, new in zip(before, after):
        assert torch.equal(old.input_ids, new.input_ids) and torch.equal(old.image_embeds, new.image_embeds)
        assert torch.equal(old.position_ids, new.position_ids) and new.loss_mask is None
    lengths = [list(tokens) for tokens in RunIndex.of(older).lengths]  # num_tokens made from input_ids
    assert lengths == [list(tokens) for tokens in RunIndex.of(qwen_run).lengths]
    upgraded = load_run_dataset(older, cache_dir=str(tmp_path / "cache"))
    assert upgraded.features == load_run_dataset(qwen_run, cache_dir=str(tmp_path / "cache")).features
    assert upgrade_run(older).shards == 0  # nothing left to do


def test_an_upgrade_stopped_part_way_finishes_when_run_again(qwen_run, tmp_path):
    older = as_format_1(qwen_run, tmp_path / "qwen", marker=True)
    layout = RunLayout(older)
    first = all_manifests_raw(layout)[0]
    _rewrite(layout.listed(first["files"][DATA]["path"]), SHARDS[DATA])  # then the process died
    assert run_format(layout) == 1
    upgrade_run(older)
    assert verify_run(older) == [] and len(list(read_run(older))) == len(list(read_run(qwen_run)))
    assert read_manifest(layout.manifest(first["unit"])).shards(DATA)[0].sha256 != first["files"][DATA]["sha256"]


def all_manifests_raw(layout: RunLayout) -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted(layout.manifests.glob("*.json"))]


def _units_without(run: Path) -> int:
    """The data and quarantine files a unit of the run did not write (it had no record of that kind)."""
    layout = RunLayout(run)
    return sum(not m.shards(kind) for m in all_manifests(layout) for kind in (DATA, QUARANTINE))
