"""The run directory on its own: one fingerprint per run, and `_SUCCESS` only once everything is committed."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from batchvlm.config import ConfigError
from batchvlm.executor.config import JobConfig
from batchvlm.executor.fingerprint import run_fingerprint
from batchvlm.pipeline.decode import DecodeConfig
from batchvlm.pipeline.jpeg import decoder_of
from batchvlm.rundir.sink import OutputConfig
from batchvlm.sources.config import dataset_config
from batchvlm.records import WorkUnit
from batchvlm.rundir.dedup import commit_bucket
from batchvlm.rundir.durable import durable_write_json
from batchvlm.rundir.layout import RunLayout
from batchvlm.rundir.run import RunDir
from batchvlm.rundir.workunits import Plan

ONE_RANK = SimpleNamespace(is_main=True, barrier=lambda: None)


@pytest.fixture(scope="module")
def encoder(kimi_family):
    return kimi_family.load_encoder(torch.device("cpu"), torch.float32)


def open_run(path, job: JobConfig, family, encoder) -> RunDir:
    return RunDir(RunLayout(path), run_fingerprint(job, family, encoder), "run_name: test\n", ONE_RANK)


def test_a_run_directory_refuses_another_fingerprint_naming_what_differs(tmp_path, kimi_family, encoder):
    open_run(tmp_path, JobConfig(), kimi_family, encoder)
    open_run(tmp_path, JobConfig(), kimi_family, encoder)  # the same job reopens it
    other = JobConfig(output=OutputConfig(embed_dtype="float16"))
    with pytest.raises(ConfigError, match="embed_dtype: 'bfloat16' -> 'float16'.*run_name="):
        open_run(tmp_path, other, kimi_family, encoder)


def test_how_missing_ids_are_made_is_part_of_the_fingerprint(tmp_path, kimi_family, encoder):
    open_run(tmp_path, JobConfig(), kimi_family, encoder)
    content = JobConfig(dataset=dataset_config("demo", missing_ids="content"))
    with pytest.raises(ConfigError, match="another fingerprint.*missing_ids: 'quarantine' -> 'content'"):
        open_run(tmp_path, content, kimi_family, encoder)
    open_run(tmp_path / "content", content, kimi_family, encoder)
    with pytest.raises(ConfigError, match="missing_ids: 'content' -> 'position'"):
        open_run(tmp_path / "content", JobConfig(dataset=dataset_config("demo", missing_ids="position")), kimi_family,
                 encoder)


def test_which_decoder_made_a_runs_jpeg_pixels_is_in_its_fingerprint_the_reference_or_not(tmp_path, kimi_family,
                                                                                         encoder):
    safe = open_run(tmp_path / "safe", JobConfig(), kimi_family, encoder).fingerprint
    assert safe["jpeg_decoder"].startswith("pillow ") and safe["jpeg_decoder"].endswith("the reference")
    device = JobConfig(decode=DecodeConfig(jpeg="device"))
    fingerprint = open_run(tmp_path / "device", device, kimi_family, encoder).fingerprint
    assert fingerprint["jpeg_decoder"].startswith("torchvision ") and "libjpeg-turbo" in fingerprint["jpeg_decoder"]
    assert decoder_of("device", torch.device("cuda")).endswith(f"nvjpeg (CUDA {torch.version.cuda})")
    with pytest.raises(ConfigError, match="jpeg_decoder: 'pillow"):
        open_run(tmp_path / "safe", device, kimi_family, encoder)


def _manifest(run_dir, unit: WorkUnit, written: int, quarantined: dict[str, int]) -> None:
    durable_write_json(run_dir / "manifest" / f"{unit.unit_id}.json", {
        "unit": unit.unit_id, "source": unit.source, "start": unit.start, "stop": unit.stop,
        "records_in": written + sum(quarantined.values()), "written": written, "quarantined": sum(quarantined.values()),
        "checks": quarantined, "files": {}, "rank": 0, "claim": "a0", "fallbacks": {},
        "parity": {"checked_images": 0, "failed_images": 0}})


def test_success_comes_once_every_unit_and_bucket_is_committed_with_duplicates_counted(tmp_path, kimi_family,
                                                                                       encoder):
    layout = RunLayout(tmp_path)
    run = open_run(tmp_path, JobConfig(), kimi_family, encoder)
    (tmp_path / "manifest").mkdir()
    units = [WorkUnit("a-00000000-00000004", "a", 0, 4), WorkUnit("b-00000000-00000004", "b", 0, 4)]
    plan = Plan([], {}, units, dedup_buckets=2)
    _manifest(tmp_path, units[0], 3, {"decode.truncated": 1})
    assert not run.finish(plan, 1.0, 4, 0)["complete"]
    _manifest(tmp_path, units[1], 4, {})
    commit_bucket(layout, 0, [{"id": "x", "unit": units[1].unit_id, "source": "b", "row": 2, "kind": "data",
                                 "first_unit": units[0].unit_id, "first_row": 0}])
    assert not run.finish(plan, 1.0, 8, 0)["complete"] and not (tmp_path / "_SUCCESS").exists()  # bucket 1 open
    commit_bucket(layout, 1, [])
    summary = run.finish(plan, 1.0, 8, 0)
    assert summary["complete"] and json.loads((tmp_path / "_SUCCESS").read_text()) == summary
    assert (summary["records_in"], summary["written"], summary["quarantined"]) == (8, 6, 2)
    assert summary["by_check"] == {"decode.truncated": 1, "source.duplicate_id": 1}
