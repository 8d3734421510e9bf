"""The output contract: every column declared once, and the writer's schemas, the row check, the readers' columns
and the tables of docs/output.md all taken from the declarations."""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch

from conftest import REPO
from batchvlm.checks import failure
from batchvlm.format.schema import (DATA_COLUMNS, DATA_SCHEMA, DATA_SHARD, EMBED_DTYPES, EXTRA_OUTPUTS, FRAME, IMAGE,
                                    QUARANTINE_COLUMNS, QUARANTINE_SCHEMA, QUARANTINE_SHARD, TENSOR_COLUMNS, TEXT,
                                    RowError, column_table)
from batchvlm.pipeline.assemble import data_row, quarantine_row
from batchvlm.records import (EncodedRecord, ImagePlan, PreparedRecord, QuarantinedRecord, SourceRecord, TokenLayout,
                              Turn)
from batchvlm.rundir.sink import ShardWriter


def test_every_embedding_column_is_raw_bytes_and_nullable_where_a_family_may_lack_it():
    assert DATA_SCHEMA.field("image_embeds").type == pa.large_binary()  # every record's, empty without images
    assert "image_embeds" in DATA_SHARD.required
    for name in EXTRA_OUTPUTS:
        assert DATA_SCHEMA.field(name).type == pa.large_binary() and name not in DATA_SHARD.required


def test_token_tags_and_dtypes_are_distinct_and_a_quarantine_row_keeps_its_evidence():
    assert len({TEXT, IMAGE, FRAME}) == 3
    assert {dtype.itemsize for dtype in EMBED_DTYPES.values()} == {2, 4}
    assert {"id", "source", "row", "check", "expected", "observed", "image_bytes", "fingerprint"} <= set(
        QUARANTINE_SCHEMA.names)


def test_the_row_builders_write_exactly_the_declared_columns():
    plan = ImagePlan((4, 4), (4, 4), (4, 4), (1, 2, 1), 2)
    source = SourceRecord("r", "u", "a.parquet", 0, "<image>", [], turns=[Turn("user", (None,))])
    layout = TokenLayout(input_ids=[5, 9, 9], image_spans=[(1, 2)], token_tags=[0, 1, 1])
    encoded = EncodedRecord(PreparedRecord(source, [], [plan], layout), [torch.ones(2, 2)])
    row = data_row(encoded, torch.float32, {"image_embeds": 2})
    assert row.keys() == DATA_SHARD.names
    DATA_SHARD.check_row(row)
    quarantined = quarantine_row(QuarantinedRecord(source, failure("decode.unreadable", "not an image")), 10, "f")
    assert quarantined.keys() == QUARANTINE_SHARD.names
    QUARANTINE_SHARD.check_row(quarantined)


def test_a_row_with_a_misspelt_or_missing_key_fails_at_write_naming_it(tmp_path):
    """Before the contract, a misspelt key became a column of nulls without a word."""
    plan = ImagePlan((4, 4), (4, 4), (4, 4), (1, 2, 1), 2)
    layout = TokenLayout(input_ids=[5, 9, 9], image_spans=[(1, 2)], token_tags=[0, 1, 1])
    source = SourceRecord("r", "u", "a.parquet", 0, "<image>", [])
    row = data_row(EncodedRecord(PreparedRecord(source, [], [plan], layout), [torch.ones(2, 2)]), torch.float32,
                   {"image_embeds": 2})
    writer = ShardWriter(lambda n: tmp_path / f"{n}.parquet", DATA_SHARD, {}, None, 1 << 20)
    misspelt = {**{key: value for key, value in row.items() if key != "rope_delta"}, "rope_detla": None}
    with pytest.raises(RowError, match="row of 'r': undeclared rope_detla; missing rope_delta"):
        writer.append(misspelt)
    with pytest.raises(RowError, match="row of 'r': no value in num_tokens"):
        writer.append({**row, "num_tokens": None})
    writer.append(row)


def test_the_readers_take_their_columns_from_the_declarations():
    names = {column.name for column in DATA_COLUMNS}
    assert set(TENSOR_COLUMNS) <= names and set(EXTRA_OUTPUTS) <= set(TENSOR_COLUMNS)
    assert {"id", "input_ids", "image_embeds", "grid_thw", "image_spans", "token_tags", "position_ids",
            "loss_mask"} <= set(TENSOR_COLUMNS)


def test_docs_output_shows_the_declared_columns():
    """The page's tables are the contract's own (regenerate them with format.schema.column_table)."""
    page = (REPO / "docs" / "output.md").read_text()
    for columns in (DATA_COLUMNS, QUARANTINE_COLUMNS):
        assert column_table(columns) in page, f"docs/output.md:\n{column_table(columns)}"
    assert "batchvlm.pipeline.assemble.DATA_SCHEMA" not in page  # where the page once said the columns live


def test_no_column_holds_a_null_where_pyarrow_before_26_cannot_read_it_back():
    """pyarrow 15-25 fail to read a Parquet column whose fixed-size list holds a null (`Expected all lists to be of
    size=3`), whichever version wrote it: no column that can be null holds a fixed-size list at any depth (where every
    record writes one, none is null)."""
    def fixed_lists(kind: pa.DataType) -> list[pa.DataType]:
        found = [kind] if pa.types.is_fixed_size_list(kind) else []
        children = [kind.field(i).type for i in range(kind.num_fields)] if pa.types.is_struct(kind) else (
            [kind.value_type] if pa.types.is_list(kind) or pa.types.is_fixed_size_list(kind) else [])
        return found + [inner for child in children for inner in fixed_lists(child)]

    for column in DATA_COLUMNS + QUARANTINE_COLUMNS:
        if not column.required:
            assert fixed_lists(column.type) == [], column.name
    assert DATA_SCHEMA.field("position_ids").type == pa.list_(pa.list_(pa.int32()))


def test_the_layout_pyarrow_before_26_cannot_read_is_caught_by_the_rule():
    """The rule above refuses position_ids as format 1 stored it (a fixed-size list of three lists, null for every
    family but Qwen's), which pyarrow 25.0.1 and 15.0.2 fail to read back."""
    old = pa.list_(pa.list_(pa.int32()), 3)
    assert pa.types.is_fixed_size_list(old) and not pa.types.is_fixed_size_list(DATA_SCHEMA.field("position_ids").type)
