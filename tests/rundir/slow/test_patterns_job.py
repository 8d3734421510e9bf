"""The job runs a pattern too large to list unit by unit, and quarantines a gap."""

from __future__ import annotations

import json

import pytest

from batchvlm.executor.config import JobConfig
from batchvlm.sources.config import dataset_config
from test_patterns import write_tar

# a run of the job
pytestmark = pytest.mark.slow


def test_the_job_runs_a_pattern_too_large_to_list_unit_by_unit_and_quarantines_a_gap(tmp_path, monkeypatch):
    import batchvlm.sources.files
    from batchvlm.executor.config import RuntimeConfig
    from batchvlm.executor.tally import ChecksConfig
    from batchvlm.pipeline.decode import DecodeConfig
    from batchvlm.rundir.sink import OutputConfig
    from batchvlm.executor.job import run_job
    from batchvlm.review.status import run_status
    from batchvlm.rundir.verify import verify_run
    from batchvlm.training.reader import read_run

    monkeypatch.setattr(batchvlm.sources.files, "LISTED_NAMES", 2)  # four names are "too many" here: not listed
    for index in (0, 1, 3):  # 00002 is a gap in the shard list
        write_tar(tmp_path / f"{index:05d}.tar", f"key{index}")
    job = JobConfig(run_name="gaps", output=OutputConfig(root=str(tmp_path)),
                    dataset=dataset_config("webdataset", path=str(tmp_path / "{00000..00003}.tar"),
                                          id_column="__key__"),
                    decode=DecodeConfig(isolation="none"), checks=ChecksConfig(max_quarantine_fraction=1),
                    runtime=RuntimeConfig(num_workers=0, progress=False))
    summary = run_job(job, tmp_path / "gaps")
    assert (summary["units"], summary["written"], summary["by_check"]) == (4, 3, {"source.missing_input": 1})
    assert verify_run(tmp_path / "gaps") == [] and run_status(tmp_path / "gaps").state == "complete"
    assert sorted(record.id for record in read_run(tmp_path / "gaps")) == ["key0", "key1", "key3"]
    assert "pattern" in json.loads((tmp_path / "gaps" / "units.json").read_text())["inputs"]
