"""The preprocessing guard in the real job: an image whose backend result fails a check is redone on
the CPU path (preprocess.fallback=cpu, counted in _SUCCESS) or its record quarantined. Other records never change."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from batchvlm.executor.config import JobConfig, RuntimeConfig
from batchvlm.executor.tally import ChecksConfig
from batchvlm.families import ModelConfig
from batchvlm.pipeline.preprocess import PreprocessConfig
from batchvlm.rundir.sink import OutputConfig
from batchvlm.demo import demo_rows
from batchvlm.executor.job import rank_job

TARGET = "rocket_strip"  # shares a packed batch with other records
BAD_RECORDS = {"bad_truncated_jpeg", "bad_not_an_image", "bad_placeholder_count"}


def run(root: Path, name: str, fallback: str = "cpu") -> Path:
    # On the CPU wherever the tests run, so the fallback's rows are the torch backend's, bit for bit.
    cfg = JobConfig(run_name=name, model=ModelConfig(device="cpu"), output=OutputConfig(root=str(root)),
                    preprocess=PreprocessConfig(fallback=fallback),
                    runtime=RuntimeConfig(num_workers=0, progress=False),
                    checks=ChecksConfig(max_quarantine_fraction=1))
    rank_job(cfg, root / name).run_all()
    return root / name


def rows_of(run_dir: Path, kind: str) -> dict[str, dict]:
    return {row["id"]: row for path in sorted((run_dir / kind).glob("*.parquet"))
            for row in pq.read_table(path).to_pylist()}


def target_digest() -> str:
    blob = next(row["images"][0] for row in demo_rows() if row["id"] == TARGET)
    return hashlib.sha256(blob).hexdigest()


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> dict[str, dict]:
    return rows_of(run(tmp_path_factory.mktemp("clean"), "clean"), "data")


@pytest.mark.slow
def test_a_wrong_grid_is_redone_on_the_cpu_path_and_counted_in_success(tmp_path, clean, monkeypatch):
    monkeypatch.setenv("BATCHVLM_FAULTS", f"preprocess.wrong_grid={target_digest()[:16]}")
    run_dir = run(tmp_path, "fallback")
    assert set(rows_of(run_dir, "quarantine")) == BAD_RECORDS
    written = rows_of(run_dir, "data")
    assert set(written) == set(clean)
    for record_id, row in written.items():
        assert row == clean[record_id], record_id  # on CPU the fallback is the torch path: the target too
    success = json.loads((run_dir / "_SUCCESS").read_text())
    assert success["fallbacks"] == {"preprocess.grid_match": 1}


@pytest.mark.slow
def test_fallbacks_of_units_committed_before_a_restart_are_still_counted(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHVLM_FAULTS", f"preprocess.wrong_grid={target_digest()[:16]}")
    run_dir = run(tmp_path, "restart")
    manifests = {path: json.loads(path.read_text()) for path in (run_dir / "manifest").glob("*.json")}
    assert sorted(sum(m["fallbacks"].values()) for m in manifests.values()) == [0, 1]
    # As if the job had died after the target's unit committed: the other unit and _SUCCESS are gone.
    other = next(path for path, manifest in manifests.items() if not manifest["fallbacks"])
    other.unlink()
    (run_dir / "_SUCCESS").unlink()
    monkeypatch.delenv("BATCHVLM_FAULTS")
    run(tmp_path, "restart")
    assert json.loads((run_dir / "_SUCCESS").read_text())["fallbacks"] == {"preprocess.grid_match": 1}


@pytest.mark.slow
def test_a_wrong_grid_quarantines_its_record_with_fallback_quarantine(tmp_path, clean, monkeypatch):
    monkeypatch.setenv("BATCHVLM_FAULTS", f"preprocess.wrong_grid={target_digest()[:16]}")
    run_dir = run(tmp_path, "quarantine", fallback="quarantine")
    quarantined = rows_of(run_dir, "quarantine")
    assert set(quarantined) == BAD_RECORDS | {TARGET}
    assert quarantined[TARGET]["check"] == "preprocess.grid_match"
    written = rows_of(run_dir, "data")
    assert set(written) == set(clean) - {TARGET}
    for record_id, row in written.items():
        assert row == clean[record_id], record_id
    assert json.loads((run_dir / "_SUCCESS").read_text())["fallbacks"] == {}
