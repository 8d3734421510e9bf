"""JSON inputs: JSON Lines cut at byte offsets from the file's size alone, JSON arrays indexed once; a record's row is
its byte offset, so a unit and a requeued record are read by seeking."""

from __future__ import annotations

import json

import pytest

from batchvlm.config import ConfigError
from batchvlm.sources.config import dataset_config
from batchvlm.sources import make_source


def record(i: int) -> dict:
    # Lengths that vary, and text that is not ASCII: byte offsets are not character offsets.
    return {"id": f"r{i:03d}", "images": [], "text": "é" * (i % 7) + f" caption {i}" + " x" * (i % 11)}


def source_of(path, **options):
    return make_source(dataset_config("json", path=str(path), **options))


def read_all(source):
    units = source.plan()
    return units, [r for unit in units for r in source.records(unit)]


@pytest.mark.parametrize("unit_bytes", [1, 97, 1000, 10**6])
def test_json_lines_units_cut_at_any_byte_hold_every_record_once(tmp_path, unit_bytes):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(record(i), ensure_ascii=False) + "\n" for i in range(60)))
    units, records = read_all(source_of(path, unit_bytes=unit_bytes))
    assert [r.id for r in records] == [f"r{i:03d}" for i in range(60)]
    assert all(unit.stop is None for unit in units) and sum(unit.nbytes for unit in units) == path.stat().st_size
    for unit in units:  # a unit's records count from 0; a unit inside one line has none
        seqs = [r.seq for r in records if r.unit_id == unit.unit_id]
        assert seqs == list(range(len(seqs)))


def test_planning_json_lines_reads_no_record(tmp_path):
    """O(files): the plan comes from the size; a file whose every line after the first is broken plans the same."""
    path = tmp_path / "data.jsonl"
    path.write_bytes(json.dumps(record(0)).encode() + b"\n" + b"\xff{not json\n" * 5000)
    units = source_of(path, unit_bytes=4096).plan()
    assert sum(unit.nbytes for unit in units) == path.stat().st_size


def test_a_json_array_is_indexed_once_and_cut_at_element_boundaries(tmp_path):
    path = tmp_path / "data.json"
    path.write_text(json.dumps([record(i) for i in range(50)], indent=2, ensure_ascii=False))
    units, records = read_all(source_of(path, unit_records=7, unit_bytes=10**6))
    assert len(units) == 8 and [r.id for r in records] == [f"r{i:03d}" for i in range(50)]
    raw = path.read_bytes()
    assert all(raw[r.row:r.row + 1] == b"{" for r in records)  # each row is where its element starts


def test_a_record_is_read_again_by_its_byte_offset(tmp_path):
    for name, text in (("a.jsonl", "".join(json.dumps(record(i)) + "\n" for i in range(20))),
                       ("b.json", json.dumps([record(i) for i in range(20)]))):
        (tmp_path / name).write_text(text)
        source = source_of(tmp_path / name, unit_bytes=200)
        _, records = read_all(source)
        wanted = [records[3].row, records[17].row]
        name_in_plan = next(iter(source.inputs))
        assert [r.id for r in source.records_at(name_in_plan, wanted)] == ["r003", "r017"]
        assert [i for _, i in source.all_ids(name_in_plan)] == [f"r{i:03d}" for i in range(20)]


def test_a_broken_line_is_quarantined_alone(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(record(0)) + "\n{broken\n[1, 2]\n" + json.dumps(record(1)) + "\n")
    _, records = read_all(source_of(path))
    assert [r.failure.check if r.failure else r.id for r in records] == \
        ["r000", "source.malformed_row", "source.malformed_row", "r001"]


def test_limit_reads_the_first_rows_of_each_file(tmp_path):
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(record(i)) + "\n" for i in range(30)))
    (tmp_path / "b.json").write_text(json.dumps([record(i) for i in range(30)]))
    _, records = read_all(source_of(tmp_path, limit=4, unit_bytes=64))
    assert len(records) == 8


def test_a_file_that_is_no_json_array_is_refused_at_planning(tmp_path):
    path = tmp_path / "data.json"
    path.write_text('[{"id": "a"}, {"id": ')
    with pytest.raises(ConfigError, match="not a JSON array"):
        source_of(path).plan()


LLAMA_FACTORY = [  # LLaMA-Factory's sharegpt-style records: no id field
    {"messages": [{"role": "user", "content": f"<image>Who is in picture {i}?"},
                  {"role": "assistant", "content": "Nobody."}], "images": [f"img/{i}.jpg"]} for i in range(6)]


def _ids(path, **options) -> list[str | None]:
    source = source_of(path, format="messages", text_column="messages", **options)
    return [r.id for r in read_all(source)[1]]


def test_a_dataset_without_ids_gets_none_unless_missing_ids_makes_them(tmp_path):
    path = tmp_path / "mllm.json"
    path.write_text(json.dumps(LLAMA_FACTORY, indent=2))
    assert _ids(path) == [None] * 6  # quarantined under source.missing_id by the job
    content = _ids(path, missing_ids="content")
    assert len(set(content)) == 6 and all(i.startswith("sha256:") and len(i) == 39 for i in content)
    position = _ids(path, missing_ids="position")
    raw = path.read_bytes()
    assert [raw[int(i.rsplit("#", 1)[1]):][:1] for i in position] == [b"{"] * 6

    records = [dict(record) for record in LLAMA_FACTORY]
    records[1] = {**records[1], "images": ["img/other.jpg"]}  # one record edited, the others moved by nothing
    records.insert(0, {"messages": [], "images": []})  # and a record added before them all
    path.write_text(json.dumps(records, indent=2))
    edited = _ids(path, missing_ids="content")
    assert edited[1:] == [content[0], edited[2], *content[2:]] and edited[2] != content[1]
    assert _ids(path, missing_ids="position") != position[:1] + position  # positions moved


def test_missing_ids_takes_one_of_its_choices_naming_the_key():
    with pytest.raises(ConfigError, match="dataset.missing_ids='hash' is not one of quarantine, content, position"):
        dataset_config("json", missing_ids="hash")


def test_requeue_scans_the_made_ids_as_the_job_made_them(tmp_path):
    path = tmp_path / "mllm.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in LLAMA_FACTORY))
    source = source_of(path, format="messages", text_column="messages", missing_ids="content")
    assert [i for _, i in source.all_ids(next(iter(source.inputs)))] == [r.id for r in read_all(source)[1]]
