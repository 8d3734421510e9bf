"""What every source shares: columns named in the config, the rows a job reads through them, images given as URLs."""

from __future__ import annotations

import io
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image
from skimage import data

from batchvlm.config import ConfigError
from batchvlm.pipeline.decode import DecodeConfig
from batchvlm.sources.config import dataset_config
from batchvlm.pipeline.decode import read_bytes
from batchvlm.sources import make_source
from batchvlm.training.reader import read_run
from conftest import run_embed, run_job_command, summary_in_process


def jpeg(pixels) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG")
    return buffer.getvalue()


PHOTOS = {"cat": data.chelsea(), "cup": data.coffee()[:200, :300], "coins": data.coins()}
FEATURES = datasets.Features({"key": datasets.Value("string"), "pics": datasets.List(datasets.Image()),
                              "caption": datasets.Value("string")})


def _table(keys):
    return {"key": keys, "pics": [[{"bytes": jpeg(PHOTOS[k]), "path": None}] for k in keys],
            "caption": [f"<image> a photo of {k}" for k in keys]}


def _columns(**extra) -> dict:
    return dict(id_column="key", images_column="pics", text_column="caption", **extra)


def test_a_missing_column_is_a_config_error_naming_the_key(tmp_path):
    datasets.Dataset.from_dict(_table(["cat"]), features=FEATURES).save_to_disk(tmp_path / "ds")
    with pytest.raises(ConfigError, match="dataset.images_column='images'"):
        make_source(dataset_config("disk", path=str(tmp_path / "ds"), id_column="key",
                                  text_column="caption")).plan()


@pytest.mark.slow
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


# -- streaming sources, footer-only planning, WebDataset and s3 -------------------------------------


def test_an_image_given_as_a_url_is_refused_by_name_unless_fetching_is_allowed(tmp_path):
    from batchvlm.checks import CheckFailed
    from batchvlm.sources.rows import image_ref

    photo = tmp_path / "cat.jpg"
    photo.write_bytes(jpeg(PHOTOS["cat"]))
    url = photo.as_uri()  # file:///...: fsspec reads it like any remote URL, with no network
    refused = image_ref(url, str(tmp_path), dataset_config("parquet", path="x"))
    with pytest.raises(CheckFailed, match="given as a URL .*dataset.fetch_urls=true") as caught:
        read_bytes(refused, DecodeConfig(), 0)
    assert caught.value.check == "decode.missing_file"
    allowed = image_ref(url, str(tmp_path), dataset_config("parquet", path="x", fetch_urls=True))
    assert read_bytes(allowed, DecodeConfig(), 0) == photo.read_bytes()
    relative = image_ref("cat.jpg", str(tmp_path), dataset_config("parquet", path="x"))
    assert relative.path == str(photo)  # resolved against the input's folder, not mangled


@pytest.mark.slow
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


def test_brace_patterns_expand_as_shard_lists_are_written():
    from batchvlm.sources.files import expand_braces

    assert list(expand_braces("s3://b/{00008..00011}.tar")) == [f"s3://b/{i:05d}.tar" for i in range(8, 12)]
    assert list(expand_braces("x/{a,b}/{1..2}.parquet")) == ["x/a/1.parquet", "x/a/2.parquet", "x/b/1.parquet",
                                                             "x/b/2.parquet"]
    assert list(expand_braces("plain.tar")) == ["plain.tar"]
    with pytest.raises(ConfigError, match=r"\{x\} is neither a range"):
        expand_braces("odd{x}.tar")
    with pytest.raises(ConfigError, match="nested or unpaired"):
        expand_braces("x/{a,{b,c}}.tar")


def test_a_list_of_paths_and_brace_patterns_name_the_inputs_and_a_missing_one_is_named(tmp_path):
    from batchvlm.sources.files import list_files

    for index in range(4):
        (tmp_path / f"part-{index:03d}.parquet").write_bytes(b"PAR1")
    (tmp_path / "other.parquet").write_bytes(b"PAR1")
    listed = list_files([str(tmp_path / "part-{000..002}.parquet"), str(tmp_path / "other.parquet")], (".parquet",), {})
    assert sorted(Path(item.location).name for item in listed) == [
        "other.parquet", "part-000.parquet", "part-001.parquet", "part-002.parquet"]
    with pytest.raises(ConfigError, match=r"2 of the 6 files it names do not exist \(first: .*part-004\.parquet"):
        list_files(str(tmp_path / "part-{000..005}.parquet"), (".parquet",), {})


@pytest.mark.slow
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
