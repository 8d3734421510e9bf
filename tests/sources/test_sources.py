"""What every source shares: columns named in the config, the rows a job reads through them, images given as URLs."""

from __future__ import annotations

import io
from pathlib import Path

import datasets
import pytest
from PIL import Image
from skimage import data

from batchvlm.config import ConfigError
from batchvlm.pipeline.decode import DecodeConfig
from batchvlm.sources.config import dataset_config
from batchvlm.pipeline.decode import read_bytes
from batchvlm.sources import make_source


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
