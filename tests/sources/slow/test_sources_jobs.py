"""The job reading sources: a parquet glob with overridden columns, brace patterns and lists, and files outside a
dataset's folder quarantined unread."""

from __future__ import annotations

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchvlm.training.reader import read_run
from conftest import run_embed, run_job_command, summary_in_process
from test_sources import FEATURES, PHOTOS, _table, jpeg

# runs of the job
pytestmark = pytest.mark.slow


def test_embed_job_reads_a_parquet_glob_with_overridden_columns(tmp_path):
    for index, keys in enumerate([["cat", "cup"], ["coins"]]):
        datasets.Dataset.from_dict(_table(keys), features=FEATURES).to_parquet(str(tmp_path / f"part-{index}.parquet"))
    result = run_embed("dataset=parquet", f"dataset.path={tmp_path}/*.parquet", "dataset.id_column=key",
                       "dataset.images_column=pics", "dataset.text_column=caption", f"output.root={tmp_path}/out",
                       "runtime.num_workers=0")
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "out" / "parquet-kimi_k25_tiny"  # deterministic name from the chosen groups
    ids = sorted(r["id"] for p in (run / "data").glob("*.parquet") for r in pq.read_table(p).to_pylist())
    assert ids == ["cat", "coins", "cup"]


def test_a_dataset_naming_files_outside_its_folder_gets_them_quarantined_unread_and_never_shown(tmp_path):
    dataset = tmp_path / "dataset"
    (dataset / "images").mkdir(parents=True)
    (dataset / "images" / "cat.jpg").write_bytes(jpeg(PHOTOS["cat"]))
    (tmp_path / "private.jpg").write_bytes(jpeg(PHOTOS["cup"]))
    pq.write_table(pa.table({"id": ["cat", "passwd", "escape"], "text": ["<image> a cat"] * 3,
                             "images": [["images/cat.jpg"], ["/etc/passwd"], ["../private.jpg"]]}),
                   dataset / "train.parquet")
    summary = summary_in_process(tmp_path, "confined", "dataset=parquet", f"dataset.path={dataset / 'train.parquet'}",
                                 "checks.max_quarantine_fraction=1")  # what it writes: in this process
    assert summary is not None and summary["complete"]
    run = tmp_path / "confined"
    quarantined = {r["id"]: r["check"] for p in (run / "quarantine").glob("*.parquet") for r in pq.read_table(p).to_pylist()}
    assert quarantined == {"passwd": "decode.path_outside_root", "escape": "decode.path_outside_root"}
    report = run_job_command("report", f"run_dir={run}", timeout=300)
    assert report.returncode == 0, report.stderr[-3000:]
    page = (run / "report" / "index.html").read_text()
    assert "data:image/jpeg;base64" not in page and "outside the image root" in page


def test_the_job_reads_a_brace_pattern_and_a_list_given_on_the_command_line(tmp_path):
    for index, keys in enumerate([["cat"], ["cup"], ["coins"]]):
        datasets.Dataset.from_dict(_table(keys), features=FEATURES).to_parquet(str(tmp_path / f"p-{index}.parquet"))
    columns = ["dataset.id_column=key", "dataset.images_column=pics", "dataset.text_column=caption"]
    # the command line's overrides as Hydra parses them (the same parser in this process as in the job's)
    braces = summary_in_process(tmp_path, "braces", "dataset=parquet", f"dataset.path='{tmp_path}/p-{{0..1}}.parquet'",
                                *columns)
    listed = summary_in_process(tmp_path, "listed", "dataset=parquet",
                                f"dataset.path=[{tmp_path}/p-0.parquet,{tmp_path}/p-2.parquet]", *columns)
    for summary in (braces, listed):
        assert summary is not None and summary["complete"]
    assert sorted(r.id for r in read_run(tmp_path / "braces")) == ["cat", "cup"]
    assert sorted(r.id for r in read_run(tmp_path / "listed")) == ["cat", "coins"]
