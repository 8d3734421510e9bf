"""The Parquet contract: every embedding column a family may fill has a column, in a dtype a reader maps back."""

from __future__ import annotations

import pyarrow as pa

from batchvlm.format.schema import DATA_SCHEMA, EMBED_DTYPES, EXTRA_OUTPUTS, FRAME, IMAGE, QUARANTINE_SCHEMA, TEXT


def test_every_embedding_column_is_raw_bytes_and_nullable_where_a_family_may_lack_it():
    for name in ["image_embeds", *EXTRA_OUTPUTS]:
        assert DATA_SCHEMA.field(name).type == pa.large_binary() and DATA_SCHEMA.field(name).nullable


def test_token_tags_and_dtypes_are_distinct_and_a_quarantine_row_keeps_its_evidence():
    assert len({TEXT, IMAGE, FRAME}) == 3
    assert {dtype.itemsize for dtype in EMBED_DTYPES.values()} == {2, 4}
    assert {"id", "source", "row", "check", "expected", "observed", "image_bytes", "fingerprint"} <= set(
        QUARANTINE_SCHEMA.names)
