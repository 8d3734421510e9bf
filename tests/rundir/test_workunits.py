"""The unit plan: made once from the inputs' metadata, read back by every restart, refused when an input (its size,
its identity) or a setting that decides which rows are read and what they mean changed."""

from __future__ import annotations

import json
import os
import shutil

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchvlm.config import ConfigError
from batchvlm.executor.config import JobConfig
from batchvlm.pipeline.decode import DecodeConfig
from batchvlm.sources.config import dataset_config
from batchvlm.rundir.layout import RunLayout
from batchvlm.records import WorkUnit
from batchvlm.rundir.workunits import Plan, block_units_for, make_plan, read_plan, write_plan
from batchvlm.sources import make_source


def write_rows(path, count: int, group: int) -> None:
    table = pa.table({"id": [f"r{i}" for i in range(count)], "images": [[b"x" * (i + 1)] for i in range(count)],
                      "text": ["t"] * count})
    pq.write_table(table, path, row_group_size=group)


def plan_of(folder, run_dir, **dataset):
    """The plan of a run over the folder's Parquet files, written where it is new, as the job does."""
    job = JobConfig(dataset=dataset_config("parquet", path=str(folder / "*.parquet"), **dataset))
    run_dir.mkdir(exist_ok=True)
    plan, new = make_plan(RunLayout(run_dir), make_source(job.dataset), job.reading_settings())
    if new:
        write_plan(RunLayout(run_dir), plan)
    return plan


def test_the_plan_is_made_once_and_read_back_as_it_was(tmp_path):
    write_rows(tmp_path / "a.parquet", 10, 5)
    write_rows(tmp_path / "b.parquet", 3, 3)
    made = plan_of(tmp_path, tmp_path / "run", unit_records=5)
    assert [unit.num_rows for unit in made.units] == [5, 5, 3] and made.dedup_buckets == 1
    assert read_plan(RunLayout(tmp_path / "run")) == made
    assert plan_of(tmp_path, tmp_path / "run", unit_records=5) == made  # a restart checks it, and keeps it


def test_units_are_claimed_largest_first():
    units = [WorkUnit("s", "x", 0, 2, nbytes=10), WorkUnit("l", "x", 2, 4, nbytes=90), WorkUnit("m", "x", 4, 9, 50)]
    assert [unit.unit_id for unit in Plan([], {}, units, 1).claim_order()] == ["l", "m", "s"]


def test_a_restart_over_changed_inputs_or_other_cuts_is_refused_naming_them(tmp_path):
    write_rows(tmp_path / "a.parquet", 10, 5)
    plan_of(tmp_path, tmp_path / "run", unit_records=5)
    with pytest.raises(ConfigError, match=r"dataset.unit_records: 5 -> 4.*run_name="):
        plan_of(tmp_path, tmp_path / "run", unit_records=4)
    write_rows(tmp_path / "a.parquet", 12, 5)
    with pytest.raises(ConfigError, match=r"a\.parquet changed \(.*size: \d+ -> \d+"):
        plan_of(tmp_path, tmp_path / "run", unit_records=5)


def test_an_input_replaced_by_another_of_the_same_size_is_refused(tmp_path):
    write_rows(tmp_path / "a.parquet", 10, 5)
    plan_of(tmp_path, tmp_path / "run")
    data = bytearray((tmp_path / "a.parquet").read_bytes())
    data[-20] ^= 1  # another file, byte for byte as long
    (tmp_path / "a.parquet").write_bytes(bytes(data))
    os.utime(tmp_path / "a.parquet", (1_000_000_000, 1_000_000_000))  # even where the clock would not tell
    with pytest.raises(ConfigError, match=r"a\.parquet changed \(mtime: "):
        plan_of(tmp_path, tmp_path / "run")


@pytest.mark.parametrize("setting", [{"text_column": "images"}, {"id_column": "text"}, {"require_images": True},
                                     {"placeholder": "<img>"}])
def test_a_resume_with_other_reading_settings_is_refused_naming_them(tmp_path, setting):
    write_rows(tmp_path / "a.parquet", 10, 5)
    plan_of(tmp_path, tmp_path / "run")
    (key,) = setting
    with pytest.raises(ConfigError, match=rf"dataset\.{key}: "):
        plan_of(tmp_path, tmp_path / "run", **setting)


def test_a_resume_with_other_decode_limits_is_refused_naming_them(tmp_path):
    write_rows(tmp_path / "a.parquet", 10, 5)
    cfg = dataset_config("parquet", path=str(tmp_path / "*.parquet"))
    layout = RunLayout(tmp_path)
    write_plan(layout, make_plan(layout, make_source(cfg), JobConfig(dataset=cfg).reading_settings())[0])
    with pytest.raises(ConfigError, match=r"decode\.max_pixels: 50000000 -> 1000"):
        make_plan(layout, make_source(cfg), JobConfig(dataset=cfg, decode=DecodeConfig(max_pixels=1000)).reading_settings())


def test_a_saved_dataset_with_rows_appended_is_refused(tmp_path):
    rows = {"id": ["a", "b"], "images": [[b"x"], [b"y"]], "text": ["t", "t"]}
    datasets.Dataset.from_dict(rows).save_to_disk(tmp_path / "ds")
    job = JobConfig(dataset=dataset_config("disk", path=str(tmp_path / "ds")))
    layout = RunLayout(tmp_path)
    write_plan(layout, make_plan(layout, make_source(job.dataset), job.reading_settings())[0])
    more = {key: values * 2 for key, values in rows.items()}
    datasets.Dataset.from_dict(more).save_to_disk(tmp_path / "ds2")
    shutil.rmtree(tmp_path / "ds")
    (tmp_path / "ds2").rename(tmp_path / "ds")
    with pytest.raises(ConfigError, match=r"rows: 2 -> 4"):
        make_plan(layout, make_source(job.dataset), job.reading_settings())


def test_blocks_cut_the_claim_order_and_are_sized_for_the_launch_that_plans_the_run(tmp_path):
    units = [WorkUnit(f"u{i:03d}", "x", i, i + 1, nbytes=1000 - i) for i in range(200)]
    assert [block_units_for(units, 8, world) for world in (1, 2, 4, 25, 200)] == [8, 8, 6, 1, 1]
    plan = Plan([], {}, units, 1, block_units=8)
    blocks = plan.blocks()
    assert [unit for block in blocks for unit in block.units] == plan.claim_order()
    assert [len(block.units) for block in blocks] == [8] * 25 and blocks[1].task == "u008"
    assert plan.block_of()["u010"] == "u008"


def test_a_plan_of_one_unit_per_block_claims_each_unit_under_its_own_id(tmp_path):
    write_rows(tmp_path / "a.parquet", 10, 5)
    layout = RunLayout(tmp_path / "run")
    plan = plan_of(tmp_path, tmp_path / "run", unit_records=5)
    raw = json.loads(layout.plan.read_text())
    raw["block_units"] = 1
    layout.plan.write_text(json.dumps(raw))
    single = read_plan(layout)
    assert single.block_units == 1 and [block.task for block in single.blocks()] == [u.unit_id for u in
                                                                                   plan.claim_order()]
