"""The device stage on the demo: overlap, the batched JPEG decode and bfloat16 change nothing that is written, and a
tower given another dtype stops the job."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from conftest import all_families

from batchvlm.executor.config import JobConfig, RuntimeConfig
from batchvlm.executor.tally import ChecksConfig
from batchvlm.families import ModelConfig
from batchvlm.pipeline.decode import DecodeConfig
from batchvlm.pipeline.preprocess import PreprocessConfig
from batchvlm.rundir.sink import OutputConfig
from batchvlm.executor.tally import SystematicFailure
from batchvlm.executor.job import rank_job
from batchvlm.pipeline.jpeg import JpegBatchDecoder
from batchvlm.rundir.layout import DATA, QUARANTINE, RunLayout
import test_device

# a demo job each
pytestmark = pytest.mark.slow
device = test_device.device  # test_device.py's fixture


# -- the job on the demo: overlap and batched JPEG decode change nothing that is written ----------------
def run_demo(root: Path, name: str, overlap: bool, jpeg: str = "safe", model: ModelConfig | None = None,
             plant=None) -> Path:
    """The demo in many small batches (a small token budget), its workers inline; `plant` changes the built job."""
    job = JobConfig(run_name=name, output=OutputConfig(root=str(root)), checks=ChecksConfig(max_quarantine_fraction=1),
                    preprocess=PreprocessConfig(token_budget=256), decode=DecodeConfig(jpeg=jpeg),
                    runtime=RuntimeConfig(num_workers=0, progress=False, overlap=overlap), model=model or ModelConfig())
    runner = rank_job(job, root / name)
    if plant is not None:
        plant(runner)
    runner.run_all()
    return root / name


def shards(run_dir: Path, kind: str) -> list[dict]:
    """The rows in shard order, without the fingerprint (the config differs, by design)."""
    return [{key: value for key, value in row.items() if key != "fingerprint"}
            for path in sorted(RunLayout(run_dir).folder(kind).glob("*.parquet"))
            for row in pq.read_table(path).to_pylist()]


def comparable(rows: list[dict], exact: bool) -> list[dict]:
    return rows if exact else [{key: value for key, value in row.items() if key != "image_embeds"} for row in rows]


@pytest.fixture(scope="module")
def batch_by_batch(tmp_path_factory) -> Path:
    return run_demo(tmp_path_factory.mktemp("off"), "off", overlap=False)


@pytest.mark.parametrize("jpeg", ["safe", "device"])
def test_the_demo_with_overlap_commits_the_same_shards_as_batch_by_batch(tmp_path, batch_by_batch, jpeg, monkeypatch):
    batched = []  # the JPEGs that the batched decoder took
    decode = JpegBatchDecoder._batched
    monkeypatch.setattr(JpegBatchDecoder, "_batched", lambda self, jpegs: batched.extend(jpegs) or decode(self, jpegs))
    run_dir = run_demo(tmp_path, "on", overlap=True, jpeg=jpeg)
    # the demo's JPEGs but the truncated one and the one whose text fails in the worker
    assert len(batched) == (14 if jpeg == "device" else 0)
    # nvJPEG's pixels are not libjpeg-turbo's: on CUDA the embeddings of device-decoded JPEGs may differ (the e2e
    # bench prints by how much); everything else must not.
    exact = jpeg == "safe" or not torch.cuda.is_available()
    for kind in (DATA, QUARANTINE):
        assert comparable(shards(run_dir, kind), exact) == comparable(shards(batch_by_batch, kind), exact), kind
    assert len(shards(run_dir, DATA)) > 10
    assert {row["check"] for row in shards(run_dir, QUARANTINE)} >= {"decode.truncated", "decode.unreadable"}


def test_when_every_batched_jpeg_decode_raises_the_safe_path_commits_the_same_shards(tmp_path, batch_by_batch,
                                                                                   monkeypatch):
    """Each JPEG of a failed batched call is decoded on the safe path, in the main process's own isolated child."""
    def failing(*args, **kwargs):
        raise RuntimeError("nvjpeg: bitstream error")

    monkeypatch.setattr("torchvision.io.decode_jpeg", failing)
    run_dir = run_demo(tmp_path, "failing", overlap=True, jpeg="device")
    for kind in (DATA, QUARANTINE):
        assert shards(run_dir, kind) == shards(batch_by_batch, kind), kind


@pytest.mark.parametrize("name", all_families())
def test_the_demo_in_bfloat16_writes_all_18_good_records(tmp_path, name):
    """Kimi's shipped dtype once quarantined 17 of the 18 (its pixels reached the bf16 tower as fp32)."""
    run_dir = run_demo(tmp_path, "bf16", overlap=True, model=ModelConfig(family=name, dtype="bfloat16"))
    assert len(shards(run_dir, DATA)) == 18
    assert {row["check"] for row in shards(run_dir, QUARANTINE)} == {"decode.truncated", "decode.unreadable",
                                                                      "text.placeholder_count"}


@pytest.mark.parametrize("overlap", [True, False])
def test_a_tower_given_pixels_in_another_dtype_stops_the_job_instead_of_quarantining_every_record(tmp_path, overlap):
    """The failure Kimi in bf16 had, planted back: its fp32 pixels reach the bf16 patch Conv2d uncast, so every record
    fails with one error. The job stops with it at the second batch; no record is quarantined for it."""
    def uncast(runner):
        encoder = runner.parts.stage.encoder
        inputs = encoder.inputs
        encoder.inputs = lambda pixel_values, grid_thw: (pixel_values, inputs(pixel_values, grid_thw)[1])

    with pytest.raises(SystematicFailure, match=r"Input type \(float\) and bias type \(c10::BFloat16\)"):
        run_demo(tmp_path, "uncast", overlap=overlap, model=ModelConfig(dtype="bfloat16"), plant=uncast)
    assert "encode.failed" not in {row["check"] for row in shards(tmp_path / "uncast", QUARANTINE)}
    assert not RunLayout(tmp_path / "uncast").success.exists()
