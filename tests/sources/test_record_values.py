"""Whatever a record holds is read into a record that can be written: a string UTF-8 cannot encode (a lone surrogate,
a byte that is not UTF-8) in its id, text or image path, an id that is neither a string nor an integer, a plain text
that is not a string: each is a named failure, the record's strings kept with backslash escapes."""

from __future__ import annotations

import io
import json
import tarfile

import pytest

from batchvlm.sources.config import dataset_config
from batchvlm.format.strings import escaped
from batchvlm.sources import make_source

LLAVA = dict(format="llava", id_column="id", images_column="image", text_column="conversations")


def turns(question: str = "<image>\nWhat is it?") -> list[dict]:
    return [{"from": "human", "value": question}, {"from": "gpt", "value": "A cat."}]


def read(path, **options):
    source = make_source(dataset_config(options.pop("kind", "json"), path=str(path), **options))
    return [record for unit in source.plan() for record in source.records(unit)]


def test_escaped_strings_show_a_lone_surrogate_and_a_raw_byte_and_keep_the_rest():
    assert escaped("a\ud800b") == "a\\ud800b"
    assert escaped(b"caf\xe9".decode("utf-8", "surrogateescape")) == "caf\\xe9"
    assert escaped("café ✓") == "café ✓"


@pytest.mark.parametrize("field", ["id", "text", "image path"])
def test_a_lone_surrogate_anywhere_in_a_json_record_is_named_and_the_record_kept_escaped(tmp_path, field):
    """`"\\ud800"` is valid JSON: read, it is a string no Parquet file can store."""
    record = {"id": "cat", "image": "cat.png", "conversations": turns()}
    if field == "id":
        record["id"] = "cat\ud800"
    elif field == "text":
        record["conversations"] = turns("<image>\nWhat is \ud800?")
    else:
        record["image"] = "cat\ud800.png"
    good = {"id": "dog", "image": "dog.png", "conversations": turns()}
    (tmp_path / "a.jsonl").write_text(json.dumps(record) + "\n" + json.dumps(good) + "\n")
    bad, good = read(tmp_path / "a.jsonl", **LLAVA)
    assert bad.failure.check == "source.invalid_unicode" and good.failure is None
    assert {"id": "'id'", "text": "'conversations'", "image path": "'image'"}[field] in bad.failure.message
    held = [bad.id, *bad.turns[0].content[1:], bad.images[0].path]
    assert "\\ud800" in "".join(held) and all(part.encode() for part in held)  # every string writable


def test_a_line_with_a_byte_that_is_not_utf8_keeps_its_id_and_the_lines_after_it(tmp_path):
    line = json.dumps({"id": "cat", "image": "cat.png", "conversations": turns("<image>\nWhat is ?")}).encode()
    broken = line.replace(b"is ?", b"is \xff?")
    (tmp_path / "a.jsonl").write_bytes(broken + b"\n" + line.replace(b'"cat"', b'"dog"') + b"\n")
    bad, good = read(tmp_path / "a.jsonl", **LLAVA)
    assert (bad.id, bad.failure.check) == ("cat", "source.invalid_unicode") and good.failure is None
    assert bad.turns[0].content == (None, "\nWhat is \\xff?")


def test_a_json_array_with_a_byte_that_is_not_utf8_is_planned_and_read_around_it(tmp_path):
    records = [{"id": name, "image": "cat.png", "conversations": turns()} for name in ("cat", "dog", "owl")]
    text = json.dumps(records, indent=1).encode().replace(b'"dog"', b'"d\xf6g"')  # Latin-1, not UTF-8
    (tmp_path / "a.json").write_bytes(text)
    cat, dog, owl = read(tmp_path / "a.json", **LLAVA, unit_records=1)
    assert (dog.id, dog.failure.check) == ("d\\xf6g", "source.invalid_unicode")
    assert cat.failure is None and owl.failure is None and owl.id == "owl"


def test_a_webdataset_text_or_key_that_is_not_utf8_is_named_not_replaced(tmp_path):
    with tarfile.open(tmp_path / "shard.tar", "w", encoding="utf-8", errors="surrogateescape") as tar:
        for key, text in ((b"cat".decode(), b"a \xe9 cat"), (b"d\xf6g".decode("utf-8", "surrogateescape"), b"a dog"),
                          ("owl", b"an owl")):
            info = tarfile.TarInfo(f"{key}.txt")
            info.size = len(text)
            tar.addfile(info, io.BytesIO(text))
    cat, dog, owl = read(tmp_path / "shard.tar", kind="webdataset", id_column="__key__", images_column="jpg",
                         text_column="txt")
    assert (cat.failure.check, cat.text) == ("source.invalid_unicode", "a \\xe9 cat")
    assert (dog.failure.check, dog.id) == ("source.invalid_unicode", "d\\xf6g")
    assert owl.failure is None and owl.text == "an owl"


@pytest.mark.parametrize("value", [True, 2.5, 1.0, ["a"], {"a": 1}], ids=repr)
def test_an_id_that_is_neither_a_string_nor_an_integer_is_named(tmp_path, value):
    (tmp_path / "a.jsonl").write_text(json.dumps({"id": value, "image": "cat.png", "conversations": turns()}) + "\n"
                                      + json.dumps({"id": 7, "image": "cat.png", "conversations": turns()}) + "\n")
    bad, good = read(tmp_path / "a.jsonl", **LLAVA)
    assert bad.failure.check == "source.invalid_id" and bad.id == str(value)  # as a reader would look it up
    assert good.failure is None and good.id == "7"


@pytest.mark.parametrize("value", [True, 3, 2.5, ["a"], {"a": 1}], ids=repr)
def test_a_plain_text_that_is_not_a_string_is_named_and_a_null_one_is_no_text(tmp_path, value):
    rows = [{"id": "bad", "image": "cat.png", "text": value}, {"id": "none", "image": "cat.png", "text": None}]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    bad, none = read(tmp_path / "a.jsonl", id_column="id", images_column="image", text_column="text")
    assert bad.failure.check == "text.not_a_string" and bad.text == json.dumps(value)
    assert none.failure is None and none.text == ""


def test_a_surrogate_escaped_inside_a_json_string_column_is_named_too(tmp_path):
    """A turns column may hold its list as a JSON string: its `\\ud800` escape is a surrogate once that is read."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    conversations = [json.dumps(turns("<image>\nWhat is \ud800?")), json.dumps(turns())]
    pq.write_table(pa.table({"id": ["bad", "good"], "image": ["a.png", "b.png"], "conversations": conversations}),
                   tmp_path / "a.parquet")
    bad, good = read(tmp_path / "a.parquet", kind="parquet", **LLAVA)
    assert bad.failure.check == "source.invalid_unicode" and good.failure is None and bad.text.encode()
