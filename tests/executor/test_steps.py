"""The job's typed steps: each takes one type and gives declared ones, everything else passes in place, and a chain
that does not fit (a step taking what nothing gives, an item nothing takes) is refused when it is built."""

from __future__ import annotations

import pytest
import torch
from test_batching import ids, record

from batchvlm.checks import failure
from batchvlm.executor.batching import Batch, TokenBudgetBatcher
from batchvlm.executor.rows import Assembler
from batchvlm.executor.steps import (WORKERS_GIVE, Assembly, Batching, Chain, ChainError, Closing, Decided, Encoding,
                                     Opening, Writing)
from batchvlm.records import (EncodedRecord, ImagePlan, Outcomes, PreparedRecord, QuarantinedRecord, Rows, SourceRecord,
                              TokenLayout, UnitEnd, UnitStart)
from batchvlm.rundir.layout import DATA, QUARANTINE


def test_the_stream_keeps_markers_and_decided_records_in_place_and_batches_the_rest():
    quarantined = QuarantinedRecord(record("bad").source, failure("decode.unreadable", "not an image"))
    text_only, start, end = record("text"), UnitStart(None, None), UnitEnd(None, 4)
    stream = [start, record("a", 60), quarantined, text_only, record("b", 60), end]
    chain = Chain(WORKERS_GIVE, [Decided(), Batching(TokenBudgetBatcher(token_budget=100, max_images=10))],
                  leaves=(UnitStart, UnitEnd, Outcomes, Batch))
    out = list(chain(stream))
    assert out[0] is start and out[1] == Outcomes([quarantined])
    assert isinstance(out[2].records[0], EncodedRecord) and out[2].records[0].prepared is text_only
    assert isinstance(out[3], Batch) and ids(out[3].records) == ["a"]  # closed by b
    assert out[4] is end and ids(out[5].records) == ["b"]  # the open batch at the end of the stream


def encoded(record_id: str) -> EncodedRecord:
    plan = ImagePlan((4, 4), (4, 4), (4, 4), (1, 2, 1), 2)
    layout = TokenLayout(input_ids=[5, 9, 9], image_spans=[(1, 2)], token_tags=[0, 1, 1])
    return EncodedRecord(PreparedRecord(SourceRecord(record_id, "u", "a.parquet", 0, "<image>", []), [], [plan],
                                        layout), [torch.ones(2, 2)])


def test_outcomes_become_rows_in_place_and_markers_pass():
    quarantined = QuarantinedRecord(SourceRecord("bad", "u", "a.parquet", 1, "", []),
                                    failure("decode.unreadable", "not an image"))
    end = UnitEnd(None, 2)
    assembler = Assembler(torch.float32, {"image_embeds": 2}, quarantine_bytes_cap=1024, fingerprint="f")
    chain = Chain((Outcomes, UnitEnd), [Assembly(assembler)], leaves=(Rows, UnitEnd))
    out = list(chain([Outcomes([encoded("ok"), quarantined]), end]))
    assert [(row.kind, row.values["id"]) for row in out[0].rows] == [(DATA, "ok"), (QUARANTINE, "bad")]
    assert out[1] is end


def test_a_chain_whose_steps_do_not_fit_is_refused_when_built():
    with pytest.raises(ChainError, match="Assembly takes Outcomes, which nothing before it gives"):
        Chain(WORKERS_GIVE, [Assembly(None), Decided()])
    with pytest.raises(ChainError, match="nothing takes Rows at the end of the chain"):
        Chain(WORKERS_GIVE, [Decided(), Batching(None), Encoding(None), Assembly(None), Opening(None), Closing(None)])
    # the job's own: every type the workers give ends in the writer
    Chain(WORKERS_GIVE, [Decided(), Batching(None), Encoding(None), Assembly(None), Writing(None, None),
                         Opening(None), Closing(None)])
