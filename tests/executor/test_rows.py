"""Rows: an encoded record becomes a data row carrying what preprocessing did to it; one whose row breaks an
invariant, and every quarantined record, a quarantine row with its evidence."""

from __future__ import annotations

import torch

from batchvlm.executor.rows import Assembler
from batchvlm.records import EncodedRecord, ImagePlan, PreparedRecord, PreprocessStats, SourceRecord, TokenLayout
from batchvlm.rundir.layout import DATA, QUARANTINE

ASSEMBLER = Assembler(torch.float32, {"image_embeds": 2}, quarantine_bytes_cap=1024, fingerprint="f")


def encoded(record_id: str, tags: int = 3) -> EncodedRecord:
    plan = ImagePlan((4, 4), (4, 4), (4, 4), (1, 2, 1), 2)
    layout = TokenLayout(input_ids=[5, 9, 9], image_spans=[(1, 2)], token_tags=[0, 1, 1][:tags])
    source = SourceRecord(record_id, "u", "a.parquet", 0, "<image>", [])
    record = PreparedRecord(source, [], [plan], layout, PreprocessStats(fallbacks={0: "preprocess.parity"}))
    return EncodedRecord(record, [torch.ones(2, 2)])


def test_an_encoded_record_becomes_a_data_row_with_its_preprocessing_counts():
    (row,) = ASSEMBLER.rows([encoded("ok")])
    assert (row.kind, row.values["id"], row.values["num_image_tokens"]) == (DATA, "ok", 2)
    assert row.preprocess["fallbacks"] == {"preprocess.parity": 1}


def test_a_row_that_breaks_an_invariant_is_quarantined_and_keeps_its_counts():
    (row,) = ASSEMBLER.rows([encoded("short_tags", tags=2)])
    assert (row.kind, row.values["check"]) == (QUARANTINE, "assemble.token_tags")
    assert row.preprocess["fallbacks"] == {"preprocess.parity": 1}

