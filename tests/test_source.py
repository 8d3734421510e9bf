"""Sources: save_to_disk folders, Parquet globs and imagefolders, read as bytes, keeping their ids."""

from __future__ import annotations

import io
import json

import datasets
import pyarrow.parquet as pq
import pytest
from PIL import Image
from skimage import data

from batchvlm.config import ConfigError, DatasetConfig
from batchvlm.pipeline.decode import read_bytes
from batchvlm.sources import make_source
from conftest import run_embed


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


def test_save_to_disk_folder_keeps_ids_and_raw_bytes(tmp_path):
    datasets.Dataset.from_dict(_table(["cat", "cup", "coins"]), features=FEATURES).save_to_disk(tmp_path / "ds")
    source = make_source(DatasetConfig(kind="disk", path=str(tmp_path / "ds"), unit_records=2, **_columns()))
    units = source.plan()
    assert [u.num_rows for u in units] == [2, 1]
    records = [r for unit in units for r in source.records(unit)]
    assert [r.id for r in records] == ["cat", "cup", "coins"]
    assert records[0].images[0].data[:2] == b"\xff\xd8"  # bytes, not a decoded PIL image
    assert records[1].text == "<image> a photo of cup"


def test_unit_ids_derive_from_file_and_range(tmp_path):
    for index, keys in enumerate([["cat", "cup"], ["coins"]]):
        datasets.Dataset.from_dict(_table(keys), features=FEATURES).to_parquet(str(tmp_path / f"part-{index}.parquet"))
    cfg = DatasetConfig(kind="parquet", path=str(tmp_path / "*.parquet"), unit_records=1, **_columns())
    first, second = [u.unit_id for u in make_source(cfg).plan()], [u.unit_id for u in make_source(cfg).plan()]
    assert first == second and len(set(first)) == 3
    assert first[0].startswith("part-0-") and first[0].endswith("-00000000-00000001")


def test_imagefolder_with_metadata_reads_captions_and_ids(tmp_path):
    folder = tmp_path / "folder"
    folder.mkdir()
    lines = []
    for key, pixels in PHOTOS.items():
        Image.fromarray(pixels).save(folder / f"{key}.png")
        lines.append(json.dumps({"file_name": f"{key}.png", "id": f"img-{key}", "text": f"<image> {key}"}))
    (folder / "metadata.jsonl").write_text("\n".join(lines))
    source = make_source(DatasetConfig(kind="imagefolder", path=str(folder), images_column="image"))
    records = [r for unit in source.plan() for r in source.records(unit)]
    assert sorted(r.id for r in records) == ["img-cat", "img-coins", "img-cup"]
    assert all(len(r.images) == 1 and read_bytes(r.images[0], 0)[:4] == b"\x89PNG" for r in records)


def test_a_missing_column_is_a_config_error_naming_the_key(tmp_path):
    datasets.Dataset.from_dict(_table(["cat"]), features=FEATURES).save_to_disk(tmp_path / "ds")
    with pytest.raises(ConfigError, match="dataset.images_column='images'"):
        make_source(DatasetConfig(kind="disk", path=str(tmp_path / "ds"), id_column="key",
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
def _rchar() -> int:
    """Bytes this process has read through read() calls (Linux), cached or not."""
    return int(dict(line.split(": ") for line in open("/proc/self/io").read().splitlines())["rchar"])


def test_planning_reads_the_footers_and_no_image_bytes(tmp_path):
    import numpy as np
    import pyarrow as pa

    noise = np.random.default_rng(0).integers(0, 255, size=(200, 50_000), dtype=np.uint8)
    table = pa.table({"id": [f"r{i}" for i in range(200)], "images": [[row.tobytes()] for row in noise],
                      "text": ["<image> noise"] * 200})
    pq.write_table(table, tmp_path / "big.parquet", row_group_size=20, compression="none")
    pq.write_table(table.slice(0, 2), tmp_path / "warm.parquet")
    make_source(DatasetConfig(kind="parquet", path=str(tmp_path / "warm.parquet"))).plan()  # imports, caches
    source = make_source(DatasetConfig(kind="parquet", path=str(tmp_path / "big.parquet"), unit_records=50))
    before = _rchar()
    units = source.plan()
    read = _rchar() - before
    assert (tmp_path / "big.parquet").stat().st_size > 10_000_000
    assert read < 200_000, f"planning read {read} bytes"
    assert [(u.start, u.stop) for u in units] == [(0, 40), (40, 80), (80, 120), (120, 160), (160, 200)]
    assert all(2_000_000 < u.nbytes < 2_100_000 for u in units)  # two row groups of 20 x 50 kB each


def test_a_unit_reads_only_its_rows_in_order(tmp_path):
    datasets.Dataset.from_dict(_table(["cat", "cup", "coins"] * 3), features=FEATURES).to_parquet(
        str(tmp_path / "p.parquet"), batch_size=2)
    source = make_source(DatasetConfig(kind="parquet", path=str(tmp_path / "p.parquet"), unit_records=4, **_columns()))
    units = source.plan()
    assert [(u.start, u.stop) for u in units] == [(0, 4), (4, 8), (8, 9)]
    records = list(source.records(units[1]))
    assert [(r.row, r.seq, r.id) for r in records] == [(4, 0, "cup"), (5, 1, "coins"), (6, 2, "cat"), (7, 3, "cup")]


def test_a_file_that_is_not_parquet_is_a_config_error_naming_the_key_and_file(tmp_path):
    (tmp_path / "notes.parquet").write_text("not parquet at all")
    with pytest.raises(ConfigError, match=r"dataset.path: .*notes.parquet is not a readable Parquet file"):
        make_source(DatasetConfig(kind="parquet", path=str(tmp_path / "notes.parquet"))).plan()


def test_a_streamed_dataset_is_one_unit_per_shard_and_copies_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "repo" / "data"
    folder.mkdir(parents=True)
    for index, keys in enumerate([["cat", "cup"], ["coins"]]):
        datasets.Dataset.from_dict(_table(keys), features=FEATURES).to_parquet(str(folder / f"train-{index}.parquet"))
    source = make_source(DatasetConfig(kind="hub", path=str(tmp_path / "repo"), **_columns()))
    units = source.plan()
    assert [(u.start, u.stop) for u in units] == [(0, None), (1, None)]
    records = [r for unit in units for r in source.records(unit)]
    assert sorted(r.id for r in records) == ["cat", "coins", "cup"]
    assert records[0].images[0].data[:2] == b"\xff\xd8"
    assert not any(path.is_file() for path in (tmp_path / "cache").rglob("*"))


def test_an_image_given_as_a_url_is_refused_by_name_unless_fetching_is_allowed(tmp_path):
    from batchvlm.checks import CheckFailed
    from batchvlm.sources import image_ref

    photo = tmp_path / "cat.jpg"
    photo.write_bytes(jpeg(PHOTOS["cat"]))
    url = photo.as_uri()  # file:///...: fsspec reads it like any remote URL, with no network
    refused = image_ref(url, str(tmp_path), DatasetConfig(kind="parquet", path="x"))
    with pytest.raises(CheckFailed, match="given as a URL .*dataset.fetch_urls=true") as caught:
        read_bytes(refused, 0)
    assert caught.value.check == "decode.missing_file"
    allowed = image_ref(url, str(tmp_path), DatasetConfig(kind="parquet", path="x", fetch_urls=True))
    assert read_bytes(allowed, 0) == photo.read_bytes()
    relative = image_ref("cat.jpg", str(tmp_path), DatasetConfig(kind="parquet", path="x"))
    assert relative.path == str(photo)  # resolved against the input's folder, not mangled
