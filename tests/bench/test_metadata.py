"""The claims bench: its counter counts what the file system is asked, its clock runs ranks one at a time in virtual
time, and the job's claims cost a few operations a unit, the same for more ranks."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchvlm.bench.metadata import MetadataOps, VirtualClock


def test_the_counter_counts_each_operation_under_the_root_by_kind_and_phase(tmp_path):
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    run.mkdir()
    elsewhere.mkdir()
    with MetadataOps(run) as ops:
        (run / "a").write_text("x")
        (elsewhere / "b").write_text("x")  # not the run's: not counted
        with ops.phase("tail"):
            assert (run / "a").exists() and not (run / "missing").exists()
            assert sorted(os.listdir(run)) == ["a"]
            os.replace(run / "a", run / "c")
        pq.write_table(pa.table({"x": [1]}), run / "t.parquet")
        assert pq.ParquetFile(run / "t.parquet").metadata.num_rows == 1
        assert sum(1 for _ in run.glob("*")) == 2  # a stat of the folder, and its two entries
    assert ops.counts == {("claim", "open"): 3, ("claim", "stat"): 3, ("tail", "stat"): 2, ("tail", "listdir"): 1,
                          ("tail", "rename"): 1, ("claim", "scandir"): 2}
    assert ops.by_phase() == {"claim": 8, "tail": 4}
    (run / "d").write_text("x")
    assert ops.count("open") == 3  # the calls are restored on leaving


def test_the_virtual_clock_runs_threads_one_at_a_time_in_the_order_they_are_due():
    clock, seen, running = VirtualClock(), [], []

    def sleeper(name: str, waits: list[float]):
        def run():
            for wait in waits:
                running.append(name)
                time.sleep(0.01)  # long enough for another thread to run, were it let
                assert running == [name]
                seen.append((clock.now, name))
                running.remove(name)
                clock.sleep(wait)
        return run

    clock.run([(0.0, sleeper("a", [5, 5])), (1.0, sleeper("b", [3, 30])), (2.0, sleeper("c", [1]))])
    assert seen == [(0, "a"), (1, "b"), (2, "c"), (4, "b"), (5, "a")]
    assert clock.now == 34


def test_the_bench_takes_task_claims(tmp_path):
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    from batchvlm.bench.tasks import BenchConfig
    from batchvlm.config import ConfigError
    from conftest import REPO

    ConfigStore.instance().store(name="bench_schema", node=BenchConfig)
    with initialize_config_dir(config_dir=str(Path(REPO) / "conf"), version_base=None):
        config = OmegaConf.to_object(compose(config_name="bench", overrides=["task=claims", "ranks=16"]))
        assert (config.task, config.ranks, config.units) == ("claims", 16, 100_000)
        with pytest.raises(ConfigError, match="units"):
            OmegaConf.to_object(compose(config_name="bench", overrides=["task=claims", "units=0"]))
