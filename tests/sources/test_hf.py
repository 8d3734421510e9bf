"""`datasets` inputs: save_to_disk folders, imagefolders and streamed datasets, read as bytes, keeping their ids."""

from __future__ import annotations

import json

import datasets
from PIL import Image
from test_sources import FEATURES, PHOTOS, _columns, _table

from batchvlm.pipeline.decode import DecodeConfig
from batchvlm.sources.config import dataset_config
from batchvlm.pipeline.decode import read_bytes
from batchvlm.sources import make_source


def test_save_to_disk_folder_keeps_ids_and_raw_bytes(tmp_path):
    datasets.Dataset.from_dict(_table(["cat", "cup", "coins"]), features=FEATURES).save_to_disk(tmp_path / "ds")
    source = make_source(dataset_config("disk", path=str(tmp_path / "ds"), unit_records=2, **_columns()))
    units = source.plan()
    assert [u.num_rows for u in units] == [2, 1]
    records = [r for unit in units for r in source.records(unit)]
    assert [r.id for r in records] == ["cat", "cup", "coins"]
    assert records[0].images[0].data[:2] == b"\xff\xd8"  # bytes, not a decoded PIL image
    assert records[1].text == "<image> a photo of cup"


def test_imagefolder_with_metadata_reads_captions_and_ids(tmp_path):
    folder = tmp_path / "folder"
    folder.mkdir()
    lines = []
    for key, pixels in PHOTOS.items():
        Image.fromarray(pixels).save(folder / f"{key}.png")
        lines.append(json.dumps({"file_name": f"{key}.png", "id": f"img-{key}", "text": f"<image> {key}"}))
    (folder / "metadata.jsonl").write_text("\n".join(lines))
    source = make_source(dataset_config("imagefolder", path=str(folder), images_column="image"))
    records = [r for unit in source.plan() for r in source.records(unit)]
    assert sorted(r.id for r in records) == ["img-cat", "img-coins", "img-cup"]
    assert all(len(r.images) == 1 and read_bytes(r.images[0], DecodeConfig(), 0)[:4] == b"\x89PNG" for r in records)


def test_a_streamed_dataset_is_one_unit_per_shard_and_copies_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "repo" / "data"
    folder.mkdir(parents=True)
    for index, keys in enumerate([["cat", "cup"], ["coins"]]):
        datasets.Dataset.from_dict(_table(keys), features=FEATURES).to_parquet(str(folder / f"train-{index}.parquet"))
    source = make_source(dataset_config("hub", path=str(tmp_path / "repo"), **_columns()))
    units = source.plan()
    assert [(u.start, u.stop) for u in units] == [(0, None), (1, None)]
    records = [r for unit in units for r in source.records(unit)]
    assert sorted(r.id for r in records) == ["cat", "coins", "cup"]
    assert records[0].images[0].data[:2] == b"\xff\xd8"
    assert not any(path.is_file() for path in (tmp_path / "cache").rglob("*"))


def test_a_video_feature_column_named_by_videos_column_is_read_undecoded_and_required(tmp_path):
    """A `datasets` Video column (dataset.videos_column) reaches the job as the clips' own bytes or paths, never
    decoded by `datasets` (torchcodec); a column the dataset lacks is refused before any work, naming the key."""
    import pytest

    from batchvlm.config import ConfigError

    features = datasets.Features({"id": datasets.Value("string"), "text": datasets.Value("string"),
                                  "images": datasets.List(datasets.Image()), "videos": datasets.List(datasets.Video())})
    media = tmp_path / "media"
    media.mkdir()
    (media / "b.webm").write_bytes(b"\x1aE\xdf\xa3")
    clips = [[{"bytes": b"\x00\x00\x00\x18ftypmp42", "path": None}], [{"bytes": None, "path": str(media / "b.webm")}]]
    datasets.Dataset.from_dict({"id": ["a", "b"], "text": ["<video> one", "<video> two"], "images": [[], []],
                                "videos": clips}, features=features).save_to_disk(tmp_path / "ds")
    columns = dict(id_column="id", text_column="text", images_column="images")
    source = make_source(dataset_config("disk", path=str(tmp_path / "ds"), videos_column="videos",
                                        **columns))
    records = {r.id: r for unit in source.plan() for r in source.records(unit)}
    assert [ref.data for ref in records["a"].videos] == [b"\x00\x00\x00\x18ftypmp42"]
    # save_to_disk embeds a path's file (its name kept): the clip's bytes
    assert [(ref.data, ref.path) for ref in records["b"].videos] == [(b"\x1aE\xdf\xa3", "b.webm")]
    assert all(record.failure is None for record in records.values())
    with pytest.raises(ConfigError, match="dataset.videos_column='clips' is not a column"):
        make_source(dataset_config("disk", path=str(tmp_path / "ds"), videos_column="clips", **columns)).plan()
