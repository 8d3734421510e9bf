"""One planted fault per check, in one record of a multi-record batch.

Each run is the real job on the demo with one stage wrapped so that exactly one record goes wrong.
That record must land in quarantine under the check, with expected and observed; every other record
must be committed bit-identical to the clean run.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from batchvlm.executor.config import JobConfig, RuntimeConfig
from batchvlm.executor.tally import ChecksConfig
from batchvlm.families import ModelConfig
from batchvlm.pipeline.preprocess import PreprocessConfig
from batchvlm.rundir.sink import OutputConfig
from batchvlm.executor.job import JobAborted, rank_job
from batchvlm.records import EncodedRecord

TARGET = "rocket_strip"  # shares a packed batch with other records; its grid (1, 6, 46) is unique in the demo
TARGET_GRID = (1, 6, 46)

# the job on the demo, once per planted fault
pytestmark = pytest.mark.slow


def job_config(root: Path, name: str, **model) -> JobConfig:
    # fallback=quarantine: the planted preprocess faults must reach quarantine, not the CPU fallback
    # (tests/executor/slow/test_preprocess_fallback.py covers that path).
    return JobConfig(run_name=name, model=ModelConfig(**model), output=OutputConfig(root=str(root)),
                     runtime=RuntimeConfig(num_workers=0, progress=False), checks=ChecksConfig(max_quarantine_fraction=1),
                     preprocess=PreprocessConfig(fallback="quarantine"))


def rows_of(run_dir: Path, kind: str) -> dict[str, dict]:
    return {row["id"]: row for path in sorted((run_dir / kind).glob("*.parquet"))
            for row in pq.read_table(path).to_pylist()}


def run(root: Path, name: str, plant=None, **model) -> Path:
    cfg = job_config(root, name, **model)
    job = rank_job(cfg, root / name)
    if plant:
        plant(job)
    job.run_all()
    return root / name


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("clean")
    return rows_of(run(root, "clean"), "data")


# -- plants ------------------------------------------------------------------------------------
class Wrapped:
    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)


class RowShortPreprocessor(Wrapped):
    def __call__(self, records):
        rows, grids, clips = self.inner(records)
        index = _image_index(records, TARGET)
        if index is not None:
            rows[index] = rows[index][:-1]
        return rows, grids, clips


class GridOffByOnePreprocessor(Wrapped):
    def __call__(self, records):
        rows, grids, clips = self.inner(records)
        index = _image_index(records, TARGET)
        if index is not None:
            t, h, w = grids[index]
            grids[index] = (t, h, w + 1)
        return rows, grids, clips


class MissingGridPreprocessor(Wrapped):
    def __call__(self, records):
        rows, grids, clips = self.inner(records)
        index = _image_index(records, TARGET)
        if index is not None:
            del grids[index]
        return rows, grids, clips


class EncoderPlant(Wrapped):
    def __init__(self, inner, change):
        super().__init__(inner)
        self.change = change

    def __call__(self, pixel_values, grid_thw):
        outputs = self.inner(pixel_values, grid_thw)
        embeds = outputs["image_embeds"]
        for index, grid in enumerate(grid_thw.tolist()):
            if tuple(grid) == TARGET_GRID:
                embeds[index] = self.change(embeds[index])
        return outputs


class RaisingEncoder(Wrapped):
    """A tower that fails (e.g. out of memory) on any batch containing the target image."""

    def __call__(self, pixel_values, grid_thw):
        if any(tuple(grid) == TARGET_GRID for grid in grid_thw.tolist()):
            raise torch.OutOfMemoryError("CUDA out of memory (planted)")
        return self.inner(pixel_values, grid_thw)


def _image_index(records, record_id):
    index = 0
    for record in records:
        if record.source.id == record_id:
            return index
        index += len(record.plans)
    return None


def with_nan(embed):
    embed = embed.clone()
    embed[0, 0] = float("nan")
    return embed


def drop_token_tag(job):
    submit = job.parts.stage.submit

    def planted(records):
        outcomes = submit(records)
        for item in outcomes:
            if isinstance(item, EncodedRecord) and item.prepared.source.id == TARGET:
                item.prepared.layout.token_tags.pop()
        return outcomes

    job.parts.stage.submit = planted


PLANTS = {
    "preprocess.feature_length": lambda job: setattr(job.parts.stage, "preprocessor",
                                                     RowShortPreprocessor(job.parts.stage.preprocessor)),
    "preprocess.grid_match": lambda job: setattr(job.parts.stage, "preprocessor",
                                                 GridOffByOnePreprocessor(job.parts.stage.preprocessor)),
    "preprocess.grid_match (missing grid)": lambda job: setattr(job.parts.stage, "preprocessor",
                                                                MissingGridPreprocessor(job.parts.stage.preprocessor)),
    "encode.output_tokens": lambda job: setattr(job.parts.stage, "encoder",
                                                EncoderPlant(job.parts.stage.encoder, lambda e: e[:-1])),
    "encode.finite": lambda job: setattr(job.parts.stage, "encoder", EncoderPlant(job.parts.stage.encoder, with_nan)),
    "encode.failed": lambda job: setattr(job.parts.stage, "encoder", RaisingEncoder(job.parts.stage.encoder)),
    "assemble.token_tags": drop_token_tag,
}


@pytest.mark.parametrize("name", sorted(PLANTS))
def test_planted_fault_quarantines_only_its_record(tmp_path, clean, name):
    run_dir = run(tmp_path, "faulty", PLANTS[name])
    check = name.split(" ")[0]
    quarantined = rows_of(run_dir, "quarantine")
    assert quarantined[TARGET]["check"] == check
    assert quarantined[TARGET]["expected"] and quarantined[TARGET]["observed"]
    assert quarantined[TARGET]["expected"] != quarantined[TARGET]["observed"]
    assert set(quarantined) == {TARGET, "bad_truncated_jpeg", "bad_not_an_image", "bad_placeholder_count"}
    written = rows_of(run_dir, "data")
    assert set(written) == set(clean) - {TARGET}
    for record_id, row in written.items():
        assert row == clean[record_id], record_id  # bit-identical, embeddings included


def test_adjacent_placeholders_without_framing_are_caught(tmp_path, clean):
    run_dir = run(tmp_path, "plain", framing="plain")
    quarantined = rows_of(run_dir, "quarantine")
    failure = quarantined["astronaut_pair"]  # "<image><image> ...": one merged run of image tokens
    assert failure["check"] == "text.image_span_count"
    assert (failure["expected"], failure["observed"]) == ("2", "1")
    written = rows_of(run_dir, "data")
    assert set(written) == set(clean) - {"astronaut_pair"}
    for record_id, row in written.items():
        assert row["image_embeds"] == clean[record_id]["image_embeds"], record_id  # framing changes ids, not pixels


def test_too_many_quarantined_records_abort_the_job(tmp_path):
    cfg = job_config(tmp_path, "abort")
    cfg.checks = ChecksConfig(max_quarantine_fraction=0.05, min_records=5)
    with pytest.raises(JobAborted, match="checks.max_quarantine_fraction=0.05"):
        rank_job(cfg, tmp_path / "abort").run_all()
    assert not (tmp_path / "abort" / "_SUCCESS").exists()
