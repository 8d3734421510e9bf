"""Brace patterns expanded lazily: a pattern of 10^9 names costs what its text does, and a plan over one too large to
list holds the pattern, each unit computed when it is claimed."""

from __future__ import annotations

import io
import json
import tarfile
import tracemalloc

import pytest

from batchvlm.config import ConfigError
from batchvlm.executor.config import JobConfig
from batchvlm.sources.config import dataset_config
from batchvlm.rundir.layout import RunLayout
from batchvlm.rundir.patterns import BracePattern
from batchvlm.rundir.workunits import make_plan, read_plan, write_plan
from batchvlm.sources import make_source

BILLION = "{000000000..999999999}"


def test_a_pattern_of_a_billion_names_costs_no_memory_and_reads_any_name_both_ways():
    tracemalloc.start()
    try:
        names = BracePattern(f"s3://bucket/{{train,val}}/{BILLION}.tar")
        assert len(names) == 2 * 10**9
        assert (names[0], names[10**9 + 42], names[-1]) == (
            "s3://bucket/train/000000000.tar", "s3://bucket/val/000000042.tar", "s3://bucket/val/999999999.tar")
        assert names.index("s3://bucket/val/000000042.tar") == 10**9 + 42
        assert [names.index(name) for name in names[5:8]] == [5, 6, 7]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 100_000  # bytes: the pattern's parts, never its names
    for stranger in ("s3://bucket/test/000000001.tar", "s3://bucket/train/1.tar"):
        with pytest.raises(ValueError):
            names.index(stranger)


def write_tar(path, key: str) -> None:
    with tarfile.open(path, "w") as tar:
        for part, data in (("text", b"a caption"),):
            info = tarfile.TarInfo(f"{key}.{part}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_a_pattern_too_large_to_list_is_planned_from_the_pattern_alone(tmp_path):
    for index in (0, 1):
        write_tar(tmp_path / f"{index:09d}.tar", f"{index:09d}")
    job = JobConfig(dataset=dataset_config("webdataset", path=str(tmp_path / f"{BILLION}.tar")))
    layout = RunLayout(tmp_path / "run")
    layout.root.mkdir()
    tracemalloc.start()
    try:
        plan, new = make_plan(layout, make_source(job.dataset), job.reading_settings(), world=64)
        write_plan(layout, plan)
        blocks = plan.blocks()
        second = blocks[1]
        by_task = plan.blocks_by_task()[second.task]
        block_of = plan.block_of()[second.units[-1].unit_id]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000 and new and plan.from_pattern
    assert len(plan.units) == 10**9 and plan.block_units == 8 and len(blocks) == 125_000_000
    first = plan.units[0]
    assert first.source == "000000000-0" and first.unit_id == "000000000-0-all" and first.nbytes > 0
    assert (by_task, block_of) == (second, second.task) and second.units[0] == plan.units[8]
    assert plan.dedup_buckets == 500 and plan.rows() is None
    assert layout.plan.stat().st_size < 4096  # the pattern and the settings, not a billion units
    again = read_plan(layout)
    assert again.units[123_456_789] == plan.units[123_456_789] and again.block_units == 8
    assert make_plan(layout, make_source(job.dataset), job.reading_settings())[1] is False  # a resume checks the pattern
    other = JobConfig(dataset=dataset_config("webdataset", path=str(tmp_path / "{000000000..999999998}.tar")))
    with pytest.raises(ConfigError, match="was planned from other inputs .*the pattern"):
        make_plan(layout, make_source(other.dataset), other.reading_settings())
    assert json.loads(layout.plan.read_text())["units"] == {"pattern": "one unit per input"}


def test_a_pattern_too_large_to_list_whose_first_file_is_missing_is_refused_before_any_work(tmp_path):
    with pytest.raises(ConfigError, match="its first file .*000000000.tar does not exist"):
        make_source(dataset_config("webdataset", path=str(tmp_path / f"{BILLION}.tar")))


def test_a_unit_of_a_file_a_pattern_names_that_is_missing_is_one_quarantined_record(tmp_path):
    write_tar(tmp_path / f"{0:09d}.tar", "a")
    source = make_source(dataset_config("webdataset", path=str(tmp_path / f"{BILLION}.tar")))
    present, missing = source.plan()[0], source.plan()[1]
    assert [record.failure for record in source.unit_records(present)] == [None]
    (record,) = source.unit_records(missing)
    assert record.failure.check == "source.missing_input" and record.id == "000000001-1#missing"
    assert record.source == str(tmp_path / "000000001.tar")


@pytest.mark.parametrize("kind", ["json", "parquet"])
def test_a_pattern_unit_is_its_whole_file_up_to_the_limit(tmp_path, kind, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    import batchvlm.sources.files

    monkeypatch.setattr(batchvlm.sources.files, "LISTED_NAMES", 1)
    rows = [{"id": f"r{n}", "images": [], "text": f"caption {n}"} for n in range(5)]
    for index in range(2):
        path = tmp_path / f"{index}.{'jsonl' if kind == 'json' else 'parquet'}"
        if kind == "json":
            path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        else:
            pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=2)
    pattern = str(tmp_path / f"{{0..1}}.{'jsonl' if kind == 'json' else 'parquet'}")
    for limit, expected in ((None, 5), (3, 3)):
        source = make_source(dataset_config(kind, path=pattern, limit=limit))
        units = source.plan()
        assert len(units) == 2 and [len(list(source.records(unit))) for unit in units] == [expected, expected]
