"""Parquet inputs: units cut from the footers alone, each read a row group at a time, in order."""

from __future__ import annotations

import re

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_sources import FEATURES, _columns, _table

from batchvlm.config import ConfigError
from batchvlm.sources.config import dataset_config
from batchvlm.sources import make_source


def test_unit_ids_derive_from_file_and_range(tmp_path):
    for index, keys in enumerate([["cat", "cup"], ["coins"]]):
        datasets.Dataset.from_dict(_table(keys), features=FEATURES).to_parquet(str(tmp_path / f"part-{index}.parquet"))
    cfg = dataset_config("parquet", path=str(tmp_path / "*.parquet"), unit_records=1, **_columns())
    first, second = [u.unit_id for u in make_source(cfg).plan()], [u.unit_id for u in make_source(cfg).plan()]
    assert first == second and len(set(first)) == 3
    assert first[0].startswith("part-0-") and first[0].endswith("-00000000-00000001")


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
    make_source(dataset_config("parquet", path=str(tmp_path / "warm.parquet"))).plan()  # imports, caches
    source = make_source(dataset_config("parquet", path=str(tmp_path / "big.parquet"), unit_records=50))
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
    source = make_source(dataset_config("parquet", path=str(tmp_path / "p.parquet"), unit_records=4, **_columns()))
    units = source.plan()
    assert [(u.start, u.stop) for u in units] == [(0, 4), (4, 8), (8, 9)]
    records = list(source.records(units[1]))
    assert [(r.row, r.seq, r.id) for r in records] == [(4, 0, "cup"), (5, 1, "coins"), (6, 2, "cat"), (7, 3, "cup")]


def test_a_file_that_is_not_parquet_is_a_config_error_naming_the_key_and_file(tmp_path):
    (tmp_path / "notes.parquet").write_text("not parquet at all")
    with pytest.raises(ConfigError, match=r"dataset.path: .*notes.parquet is not a readable Parquet file"):
        make_source(dataset_config("parquet", path=str(tmp_path / "notes.parquet"))).plan()


@pytest.mark.parametrize("column,values,key", [("text", [1, 2], "dataset.text_column='text' is of type int64"),
                                               ("id", [1.5, 2.5], "dataset.id_column='id' is of type double"),
                                               ("images", [[1, 2], [3]], "dataset.images_column='images' is of type")])
def test_a_column_of_another_type_than_the_config_means_is_refused_at_start_naming_it(tmp_path, column, values, key):
    rows = {"id": ["a", "b"], "images": [[b"png"], [b"png"]], "text": ["<image> x", "<image> y"], column: values}
    pq.write_table(pa.table(rows), tmp_path / "typed.parquet")
    with pytest.raises(ConfigError, match=re.escape(key)):
        make_source(dataset_config("parquet", path=str(tmp_path / "typed.parquet"))).plan()


@pytest.mark.parametrize("turns,accepted", [([[{"from": "human", "value": "<image> x"}]], True),
                                           (['[{"from": "human", "value": "<image> x"}]'], True),
                                           ([[1, 2]], False), ([3], False)])
def test_a_conversation_column_holds_turn_structs_or_their_json(tmp_path, turns, accepted):
    pq.write_table(pa.table({"id": ["a"], "images": [[b"png"]], "conversations": turns}), tmp_path / "chat.parquet")
    cfg = dataset_config("parquet", format="llava", text_column="conversations",
                        path=str(tmp_path / "chat.parquet"))
    if accepted:
        assert len(make_source(cfg).plan()) == 1
    else:
        with pytest.raises(ConfigError, match=r"dataset.text_column='conversations' is of type .* a list of turns"):
            make_source(cfg).plan()


def test_bare_bytes_paths_and_integer_ids_are_columns_batchvlm_reads(tmp_path):
    pq.write_table(pa.table({"id": [1, 2], "images": [b"png", b"png"], "text": ["<image> x", None]}),
                   tmp_path / "plain.parquet")
    source = make_source(dataset_config("parquet", path=str(tmp_path / "plain.parquet")))
    records = [record for unit in source.plan() for record in source.records(unit)]
    assert [(r.id, r.images[0].data, r.text) for r in records] == [("1", b"png", "<image> x"), ("2", b"png", "")]


def test_a_file_without_the_id_column_is_read_with_made_ids_where_missing_ids_says(tmp_path):
    table = pa.table({"images": [[b"\x89PNG one"], [b"\x89PNG two"], [b"\x89PNG one"]], "text": ["<image> a"] * 3})
    pq.write_table(table, tmp_path / "no_ids.parquet")
    cfg = dataset_config("parquet", path=str(tmp_path / "no_ids.parquet"))
    with pytest.raises(ConfigError, match="dataset.id_column='id' is not a column"):
        make_source(cfg).plan()
    source = make_source(dataset_config("parquet", path=cfg.path, missing_ids="content"))
    records = [record for unit in source.plan() for record in source.records(unit)]
    assert records[0].id == records[2].id != records[1].id  # the same content: one record twice (source.duplicate_id)
    assert [i for _, i in source.all_ids(next(iter(source.inputs)))] == [r.id for r in records]
