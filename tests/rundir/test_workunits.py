"""The unit plan: made once from the inputs' metadata, read back by every restart, refused when the inputs or the
parameters that cut them changed."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchvlm.config import ConfigError, DatasetConfig
from batchvlm.rundir.layout import RunLayout
from batchvlm.records import WorkUnit
from batchvlm.rundir.workunits import Plan, make_plan, read_plan
from batchvlm.sources import make_source


def write_rows(path, count: int, group: int) -> None:
    table = pa.table({"id": [f"r{i}" for i in range(count)], "images": [[b"x" * (i + 1)] for i in range(count)],
                      "text": ["t"] * count})
    pq.write_table(table, path, row_group_size=group)


def plan_of(folder, run_dir, **dataset):
    cfg = DatasetConfig(kind="parquet", path=str(folder / "*.parquet"), **dataset)
    run_dir.mkdir(exist_ok=True)  # the run directory exists before the plan (rundir.run)
    return make_plan(RunLayout(run_dir), make_source(cfg), cfg, dedup_buckets=None)


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
    with pytest.raises(ConfigError, match=r"unit_records: 5 -> 4.*run_name="):
        plan_of(tmp_path, tmp_path / "run", unit_records=4)
    write_rows(tmp_path / "a.parquet", 12, 5)
    with pytest.raises(ConfigError, match=r"a\.parquet changed size"):
        plan_of(tmp_path, tmp_path / "run", unit_records=5)
