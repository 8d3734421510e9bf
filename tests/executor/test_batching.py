"""Token-budget batches: closed before the record that would pass the budget, and the worker stream grouped."""

from __future__ import annotations

from batchvlm.executor.batching import TokenBudgetBatcher
from batchvlm.records import ImagePlan, PreparedRecord, SourceRecord


def record(record_id: str, *patches: int) -> PreparedRecord:
    """A record with one image of `n` patches per argument (a 1 x n grid)."""
    plans = [ImagePlan((n, 1), (n, 1), (n, 1), (1, n, 1), n) for n in patches]
    source = SourceRecord(id=record_id, unit_id="u", source="s.parquet", row=0, text="", images=[])
    return PreparedRecord(source=source, images=[], plans=plans, layout=None)


def ids(records) -> list[str]:
    return [r.source.id for r in records]


def test_a_batch_closes_before_the_record_that_would_pass_the_patch_budget():
    batcher = TokenBudgetBatcher(token_budget=100, max_images=10)
    assert batcher.add(record("a", 40)) is None
    assert batcher.add(record("b", 60)) is None  # exactly the budget still fits
    assert ids(batcher.add(record("c", 1))) == ["a", "b"]
    assert ids(batcher.flush()) == ["c"]


def test_a_batch_closes_before_the_record_that_would_pass_max_images():
    batcher = TokenBudgetBatcher(token_budget=10_000, max_images=3)
    assert batcher.add(record("a", 1, 1)) is None
    assert ids(batcher.add(record("b", 1, 1))) == ["a"]  # 2 + 2 images > 3
    assert ids(batcher.flush()) == ["b"]


def test_a_record_over_the_budget_is_a_batch_of_its_own():
    batcher = TokenBudgetBatcher(token_budget=100, max_images=10)
    assert batcher.add(record("huge", 500)) is None  # an empty batch takes any record
    assert ids(batcher.add(record("small", 5))) == ["huge"]


def test_flush_hands_over_the_open_batch_and_starts_an_empty_one():
    batcher = TokenBudgetBatcher(token_budget=100, max_images=10)
    batcher.add(record("a", 90))
    assert ids(batcher.flush()) == ["a"]
    assert batcher.flush() == []
    assert batcher.add(record("b", 90)) is None  # the budget counts from zero again

