"""Requeue: only the quarantined records of an earlier run, read again from the current dataset into a new run, with
lineage; the report says what the requeue fixed."""

from __future__ import annotations

import json

import pytest

from batchvlm.sources.config import dataset_config
from batchvlm.sources import make_source
from batchvlm.sources.requeue import Quarantined, locate


def _quarantined(records, check: str = "text.placeholder_count") -> list[Quarantined]:
    return [Quarantined(r.id, r.source, r.row, check, "text") for r in records]


@pytest.mark.parametrize("name", ["data.json", "data.jsonl"])
def test_a_record_of_a_json_file_edited_in_place_is_found_again_by_its_id(tmp_path, name):
    """The record's identity is its id; its byte offset is only evidence: an edit before it moves it."""
    path = tmp_path / name
    records = [{"id": f"r{i}", "images": [], "text": f"caption {i}"} for i in range(12)]

    def write() -> None:
        path.write_text(json.dumps(records) if name.endswith(".json") else
                        "".join(json.dumps(record) + "\n" for record in records))

    write()
    source = make_source(dataset_config("json", path=str(path)))
    (unit,) = source.plan()
    wanted = _quarantined([r for r in source.records(unit) if r.id in ("r5", "r9")])
    records[2]["text"] += "!!"  # two bytes more: the old offsets of r5 and r9 now point inside the record before
    records[5]["text"] = "fixed"
    write()
    found, missing = locate(make_source(dataset_config("json", path=str(path))), wanted)
    assert missing == [] and [(f.was.id, f.matched_by) for f in found] == [("r5", "id"), ("r9", "id")]
    rows = [f.row for f in found]
    assert [path.read_bytes()[row:row + 1] for row in rows] == [b"{", b"{"]
    again = make_source(dataset_config("json", path=str(path)))
    assert [(r.id, r.text) for r in again.records_at(next(iter(again.inputs)), rows)] == [("r5", "fixed"),
                                                                                         ("r9", "caption 9")]


def test_a_record_with_a_made_id_fixed_in_place_is_found_by_its_position(tmp_path):
    """missing_ids=content: the fixed record's content, so its id, changed; where it starts is what is left of it."""
    path = tmp_path / "mllm.jsonl"
    records = [{"messages": [{"role": "user", "content": f"<image> {i}"}, {"role": "assistant", "content": "ok"}],
                "images": [f"{i}.jpg"]} for i in range(6)]
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    cfg = dataset_config("json", path=str(path), format="messages", text_column="messages", missing_ids="content")
    source = make_source(cfg)
    (unit,) = source.plan()
    read = list(source.records(unit))
    wanted = _quarantined([read[2], read[4]])
    records[2]["messages"][0]["content"] = "<image> fixed, and longer"  # moves record 4 too
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    found, missing = locate(make_source(cfg), wanted)
    moved = read[4].row + len(json.dumps(records[2])) - (read[3].row - read[2].row - 1)
    assert missing == [] and [(f.was.id, f.row, f.matched_by) for f in found] == [
        (read[2].id, read[2].row, "position"), (read[4].id, moved, "id")]
