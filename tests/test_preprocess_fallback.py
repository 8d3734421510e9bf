"""The preprocessing guard in the real job: an image whose backend result fails a check is redone on
the CPU path (preprocess.fallback=cpu, counted in _SUCCESS) or its record quarantined; the sampled
parity check catches pixels that drift while every shape stays right. Other records never change."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from skimage import data

from batchvlm.checks import CheckFailed
from batchvlm.config import (ChecksConfig, ConfigError, JobConfig, ModelConfig, OutputConfig, PreprocessConfig,
                             RuntimeConfig)
from batchvlm.demo import demo_rows
from batchvlm.executor.job import Job
from batchvlm.pipeline.preprocess import PreprocessGuard, TorchPreprocessor, merged_stats, pack, resolve_backend
from batchvlm.records import DecodedImage, PreparedRecord, SourceRecord, TokenLayout

TARGET = "rocket_strip"  # shares a packed batch with other records
BAD_RECORDS = {"bad_truncated_jpeg", "bad_not_an_image", "bad_placeholder_count"}


def run(root: Path, name: str, fallback: str = "cpu") -> Path:
    # On the CPU wherever the tests run, so the fallback's rows are the torch backend's, bit for bit.
    cfg = JobConfig(run_name=name, model=ModelConfig(device="cpu"), output=OutputConfig(root=str(root)),
                    preprocess=PreprocessConfig(fallback=fallback),
                    runtime=RuntimeConfig(num_workers=0, progress=False),
                    checks=ChecksConfig(max_quarantine_fraction=1))
    Job(cfg, root / name).run_all()
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


# -- parity -----------------------------------------------------------------------------------
def first_image_of(records: list[PreparedRecord], record_id: str) -> int:
    """The batch-wide index of a record's first image."""
    return [image for r in records for image in [r.source.id] * len(r.images)].index(record_id)


class BrightenOne:
    """A backend whose pixels for one record are 5 levels too bright: shapes right, values wrong."""

    def __init__(self, inner, record_id):
        self.inner, self.record_id = inner, record_id

    def __call__(self, records):
        rows, grids = self.inner(records)
        index = first_image_of(records, self.record_id)
        rows[index] = rows[index] + 5 * float(self.inner.scale.flatten()[0])
        return rows, grids


def photo_records(family) -> list[PreparedRecord]:
    crops = {"cat": data.chelsea()[100:160, 150:250], "cup": data.coffee()[50:120, 200:260],
             "rocket": data.rocket()[150:190, 100:300]}
    records = []
    for record_id, pixels in crops.items():
        image = DecodedImage(np.ascontiguousarray(pixels), "PNG", hashlib.sha256(pixels.tobytes()).hexdigest())
        source = SourceRecord(id=record_id, unit_id="u", source="s", row=0, text="", images=[])
        records.append(PreparedRecord(source, [image], [family.plan(image.height, image.width)],
                                      TokenLayout([], [], [])))
    return records


@pytest.mark.parametrize("fallback", [True, False])
def test_parity_catches_drifting_pixels_and_falls_back_or_quarantines(kimi_family, fallback):
    records = photo_records(kimi_family)
    backend = TorchPreprocessor(kimi_family, torch.device("cpu"), "black")
    guard = PreprocessGuard(cpu=TorchPreprocessor(kimi_family, torch.device("cpu"), "black"), fallback=fallback,
                            parity_sample_rate=1.0)
    if not fallback:
        with pytest.raises(CheckFailed) as caught:
            pack(records, BrightenOne(backend, "cup"), guard)
        assert caught.value.check == "preprocess.parity" and caught.value.record is records[1]
        return
    packed = pack(records, BrightenOne(backend, "cup"), guard)
    assert torch.equal(packed.pixel_values, pack(records, backend).pixel_values)
    events = merged_stats([guard.take(record.source.id) for record in records])
    assert events == {"fallbacks": {"preprocess.parity": 1}, "parity": {"checked_images": 3, "failed_images": 1}}


class LeaveOneValueUnwritten:
    """A backend that misses one value of one record's rows (the Triton output starts as NaN)."""

    def __init__(self, inner, record_id):
        self.inner, self.record_id = inner, record_id

    def __call__(self, records):
        rows, grids = self.inner(records)
        index = first_image_of(records, self.record_id)
        rows[index] = rows[index].clone()
        rows[index].view(-1)[7] = float("nan")
        return rows, grids


def test_unwritten_values_are_caught_and_redone_on_the_cpu_path(kimi_family):
    records = photo_records(kimi_family)
    backend = TorchPreprocessor(kimi_family, torch.device("cpu"), "black")
    guard = PreprocessGuard(cpu=TorchPreprocessor(kimi_family, torch.device("cpu"), "black"), fallback=True)
    packed = pack(records, LeaveOneValueUnwritten(backend, "rocket"), guard)
    assert torch.equal(packed.pixel_values, pack(records, backend).pixel_values)
    assert guard.take("rocket")["fallbacks"] == {"preprocess.feature_length": 1}


def test_parity_sampling_is_deterministic_by_content():
    guard = PreprocessGuard(parity_sample_rate=0.25)
    digests = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(400)]
    picks = [guard.sampled(DecodedImage(np.zeros((1, 1, 3), np.uint8), "PNG", d)) for d in digests]
    assert picks == [guard.sampled(DecodedImage(np.zeros((1, 1, 3), np.uint8), "PNG", d)) for d in digests]
    assert 60 < sum(picks) < 140


def test_auto_is_triton_on_cuda_and_torch_elsewhere():
    assert resolve_backend("auto", torch.device("cuda", 0)) == "triton"
    assert resolve_backend("auto", torch.device("cpu")) == "torch"
    assert resolve_backend("reference", torch.device("cuda", 0)) == "reference"


def test_triton_without_a_gpu_is_refused_naming_the_key(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match=r"preprocess\.backend=triton needs a CUDA device"):
        resolve_backend("triton", torch.device("cpu"))


@pytest.mark.parametrize("values,key", [({"backend": "cuda"}, "preprocess.backend"),
                                        ({"fallback": "drop"}, "preprocess.fallback"),
                                        ({"parity_sample_rate": 1.5}, "preprocess.parity_sample_rate"),
                                        ({"parity_max_levels": 0}, "preprocess.parity_max_levels")])
def test_bad_preprocess_values_fail_naming_the_key(values, key):
    with pytest.raises(ConfigError, match=key):
        PreprocessConfig(**values)
