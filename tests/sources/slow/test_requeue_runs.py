"""Requeue runs of the job: the quarantined records of an earlier run read again into a new run, with lineage."""

from __future__ import annotations

import io
import json
from pathlib import Path

import datasets
import numpy as np
import pytest
from conftest import data_ids, quarantine_rows, run_embed
from PIL import Image

from batchvlm.config import ConfigError
from batchvlm.executor.config import JobConfig, RuntimeConfig
from batchvlm.executor.tally import ChecksConfig
from batchvlm.pipeline.decode import DecodeConfig
from batchvlm.rundir.sink import OutputConfig
from batchvlm.sources.config import dataset_config
from batchvlm.executor.job import run_job
from batchvlm.review.html import render
from batchvlm.review.report import build_report, summary_text
from batchvlm.rundir.verify import verify_run
from batchvlm.sources.requeue import quarantined_records, requeue_source

# runs of the job
pytestmark = pytest.mark.slow


def _job(root: Path, name: str, **fields) -> JobConfig:
    return JobConfig(run_name=name, output=OutputConfig(root=str(root)), runtime=RuntimeConfig(num_workers=0, progress=False),
                     **fields)


def test_requeue_after_raising_the_pixel_limit_moves_those_records_into_data_with_lineage(tmp_path):
    # most records quarantined on purpose: a finished run over checks.max_quarantine_fraction would end non-zero
    run_job(_job(tmp_path, "small", decode=DecodeConfig(max_pixels=100_000),
                 checks=ChecksConfig(max_quarantine_fraction=1)), tmp_path / "small")
    too_big = {row["id"] for row in quarantine_rows(tmp_path / "small") if row["check"] == "decode.too_many_pixels"}
    assert len(too_big) > 5

    requeue = _job(tmp_path, "small-requeue", requeue_from=str(tmp_path / "small"), check="decode.too_many_pixels")
    new_run = tmp_path / "small-requeue"
    run_job(requeue, new_run)
    assert verify_run(new_run) == []
    written, still = data_ids(new_run), {row["id"]: row["check"] for row in quarantine_rows(new_run)}
    assert written | set(still) == too_big  # only the requeued records, each exactly once
    assert still == {"bad_truncated_jpeg": "decode.truncated"}  # within the limit now, and truncated all along
    lineage = json.loads((new_run / "lineage.json").read_text())
    assert lineage["requeue_from"] == str((tmp_path / "small").resolve())
    assert {e["id"]: e["check"] for e in lineage["requeued"]} == {i: "decode.too_many_pixels" for i in too_big}

    report = build_report(new_run, thumbnails=False)
    assert {e["id"] for e in report.requeue.fixed} == written
    assert [e["now_check"] for e in report.requeue.still_quarantined] == ["decode.truncated"]
    assert "requeued from decode.too_many_pixels" in render(report)  # the card of the one still quarantined

    units = (new_run / "units.json").read_text()
    for path in (new_run / "manifest").glob("*.json"):  # as if it crashed before these commits
        path.unlink()
    (new_run / "_SUCCESS").unlink()
    run_job(requeue, new_run)  # resumes: the same units, every requeued record once
    assert (new_run / "units.json").read_text() == units and verify_run(new_run) == []
    assert data_ids(new_run) == written


def test_requeue_into_the_run_it_reads_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="requeue_from=.*is the run directory of this job"):
        job = _job(tmp_path, "same", requeue_from=str(tmp_path / "same"))
        requeue_source(job.dataset, job.requeue_from, job.check, tmp_path / "same")


def _png(seed: int) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (40, 56, 3), np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def _write_parquet(path: Path, rows: list[tuple[str, str]]) -> None:
    features = datasets.Features({"id": datasets.Value("string"), "images": datasets.List(datasets.Image()),
                                  "text": datasets.Value("string")})
    table = {"id": [i for i, _ in rows], "images": [[{"bytes": _png(n), "path": None}] for n in range(len(rows))],
             "text": [text for _, text in rows]}
    datasets.Dataset.from_dict(table, features=features).to_parquet(str(path))


def test_requeue_reads_the_fixed_text_from_the_dataset_and_reports_records_gone_from_it(tmp_path):
    dataset = tmp_path / "captions.parquet"
    _write_parquet(dataset, [("cat", "<image> a cat"), ("twice", "<image> and again <image>"),
                             ("gone", "<image><image>"), ("cup", "<image> a cup")])
    run_job(_job(tmp_path / "out", "captions", dataset=dataset_config("parquet", path=str(dataset))),
            tmp_path / "out" / "captions")
    assert {row["id"]: row["check"] for row in quarantine_rows(tmp_path / "out" / "captions")} == {
        "twice": "text.placeholder_count", "gone": "text.placeholder_count"}

    # the text is fixed, a row is added before it (so its row moves) and "gone" is dropped
    _write_parquet(dataset, [("new", "<image> not quarantined before"), ("cat", "<image> a cat"),
                             ("twice", "<image> once now"), ("cup", "<image> a cup")])
    result = run_embed("runtime.progress=false", f"output.root={tmp_path / 'out'}", "dataset=parquet",
                       f"dataset.path={dataset}", f"requeue_from={tmp_path / 'out' / 'captions'}")
    assert result.returncode == 0, result.stderr[-3000:]
    new_run = tmp_path / "out" / "captions-requeue"  # the default run_name of a requeue
    assert data_ids(new_run) == {"twice"} and quarantine_rows(new_run) == []
    lineage = json.loads((new_run / "lineage.json").read_text())
    assert [(e["id"], e["from_row"], e["row"], e["matched_by"]) for e in lineage["requeued"]] == [("twice", 1, 2, "id")]
    assert [e["id"] for e in lineage["not_found"]] == ["gone"]
    assert "1 records, fixed: 1  still quarantined: 0  not found: 1" in summary_text(build_report(new_run))


def test_check_selects_by_name_and_an_unknown_name_fails_naming_the_key(tmp_path):
    assert JobConfig(requeue_from="x", check="decode.truncated, text.placeholder_count").check == [
        "decode.truncated", "text.placeholder_count"]
    assert JobConfig(requeue_from="x", check=["encode.finite"]).check == ["encode.finite"]
    with pytest.raises(ConfigError, match=r"check='decode\.nope'.*decode\.nope is not a check"):
        JobConfig(requeue_from="x", check="decode.nope")
    with pytest.raises(ConfigError, match="requeue_from"):
        JobConfig(check="decode.truncated")
    with pytest.raises(ConfigError, match="requeue_from=.*not a batchvlm run directory"):
        quarantined_records(tmp_path, None)


def test_a_json_array_edited_in_place_requeues_and_reads_back_with_its_run_as_one_dataset(tmp_path):
    from batchvlm.training import LoaderConfig, PackedLoader, load_run_dataset
    from batchvlm.training.reader import read_run

    (tmp_path / "img").mkdir()
    for n in range(3):
        (tmp_path / "img" / f"{n}.png").write_bytes(_png(n))
    records = [{"id": f"r{n}", "image": f"img/{n % 3}.png", "conversations": [
        {"from": "human", "value": "<image> what is it?" if n != 2 else "<image> and <image>?"},
        {"from": "gpt", "value": "noise"}]} for n in range(6)]
    path = tmp_path / "llava.json"
    path.write_text(json.dumps(records, indent=1))
    dataset = dataset_config("json", path=str(path), format="llava", images_column="image",
                            text_column="conversations")
    run = tmp_path / "out" / "llava"
    run_job(_job(tmp_path / "out", "llava", dataset=dataset, decode=DecodeConfig(isolation="none")), run)
    assert [row["id"] for row in quarantine_rows(run)] == ["r2"]

    records[0]["conversations"][1]["value"] = "noise, described at more length than before"  # moves every record after
    records[2]["conversations"][0]["value"] = "<image> and nothing else?"  # the fix
    path.write_text(json.dumps(records, indent=1))
    requeue = tmp_path / "out" / "llava-requeue"
    run_job(_job(tmp_path / "out", "llava-requeue", dataset=dataset, decode=DecodeConfig(isolation="none"),
                 requeue_from=str(run)), requeue)
    assert data_ids(requeue) == {"r2"} and verify_run(requeue) == []
    assert [e["matched_by"] for e in json.loads((requeue / "lineage.json").read_text())["requeued"]] == ["id"]

    everything = [f"r{n}" for n in range(6)]
    assert sorted(record.id for record in read_run([run, requeue])) == everything
    assert sorted(load_run_dataset([run, requeue])["id"]) == everything
    loader = PackedLoader([run, requeue], LoaderConfig(max_tokens=4096, num_workers=0))
    assert sorted(i for batch in loader for i in batch.ids) == everything

    twice = tmp_path / "out" / "llava-requeue-2"  # the same records requeued again: read with the first, twice
    run_job(_job(tmp_path / "out", "llava-requeue-2", dataset=dataset, decode=DecodeConfig(isolation="none"),
                 requeue_from=str(run)), twice)
    with pytest.raises(ValueError, match="id 'r2' is written by both .*llava-requeue and .*llava-requeue-2"):
        list(read_run([run, requeue, twice]))
