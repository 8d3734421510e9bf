"""The durable write: nothing is seen half written, and of two exclusive writers exactly one wins."""

from __future__ import annotations

import json

from batchvlm.rundir.durable import TMP_MARK, durable_write_json, publish_exclusive, read_json, temporary_name


def test_a_durable_write_leaves_the_file_whole_and_no_temporary_behind(tmp_path):
    durable_write_json(tmp_path / "x.json", {"a": 1})
    assert read_json(tmp_path / "x.json") == {"a": 1}
    assert [path.name for path in tmp_path.iterdir()] == ["x.json"]
    assert read_json(tmp_path / "missing.json") is None


def test_of_two_exclusive_publishes_the_first_wins_and_the_second_leaves_nothing(tmp_path):
    target = tmp_path / "commit.json"
    results = []
    for writer in ("first", "second"):
        tmp = temporary_name(target).with_name(f".commit.json{TMP_MARK}{writer}")
        tmp.write_text(json.dumps({"writer": writer}))
        results.append(publish_exclusive(tmp, target))
    assert results == [True, False]
    assert read_json(target) == {"writer": "first"}
    assert [path.name for path in tmp_path.iterdir()] == ["commit.json"]
