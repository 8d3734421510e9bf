"""The device side of the driver: token-budget batches, and failures pinned on the record that caused them."""

from __future__ import annotations

import pytest

from batchvlm import driver
from batchvlm.checks import CheckFailed
from batchvlm.driver import Device, TokenBudgetBatcher
from batchvlm.records import EncodedRecord, ImagePlan, PreparedRecord, SourceRecord


def record(record_id: str, *patches: int) -> PreparedRecord:
    """A record with one image of `n` patches per argument (a 1 x n grid)."""
    plans = [ImagePlan((n, 1), (n, 1), (n, 1), (1, n, 1), n) for n in patches]
    source = SourceRecord(id=record_id, unit_id="u", source="s.parquet", row=0, text="", images=[])
    return PreparedRecord(source=source, images=[], plans=plans, layout=None)


def ids(records) -> list[str]:
    return [r.source.id if isinstance(r, PreparedRecord) else r.prepared.source.id for r in records]


# -- TokenBudgetBatcher -----------------------------------------------------------------------
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


# -- Device.encode ----------------------------------------------------------------------------
class Tower:
    """Encodes a batch unless it holds a record of `raises`; counts the batches it was given."""

    def __init__(self, raises: dict[str, Exception]):
        self.raises, self.batches = raises, []

    def __call__(self, records: list[PreparedRecord]) -> list[EncodedRecord]:
        self.batches.append(ids(records))
        for r in records:
            if r.source.id in self.raises:
                raise self.raises[r.source.id]
        return [EncodedRecord(r, []) for r in records]


@pytest.fixture
def device(monkeypatch):
    """A Device whose preprocessing passes records through and whose tower is a Tower."""
    monkeypatch.setattr(driver, "pack", lambda records, preprocessor, guard: records)
    monkeypatch.setattr(driver, "encode_batch", lambda tower, records, out_dtype=None: tower(records))
    return lambda raises: Device(preprocessor=None, encoder=Tower(raises))


def test_an_error_in_a_batch_is_bisected_to_its_record_and_the_rest_is_encoded_in_order(device):
    on_device = device({"r5": RuntimeError("CUDA out of memory")})
    batch = [record(f"r{i}", 4) for i in range(8)]
    encoded, quarantined = on_device.encode(batch)
    assert ids(encoded) == ["r0", "r1", "r2", "r3", "r4", "r6", "r7"]
    assert [(q.source.id, q.failure.check, q.failure.message) for q in quarantined] == [
        ("r5", "encode.failed", "RuntimeError: CUDA out of memory")]
    assert len(on_device.encoder.batches) == 7  # 8, then 4 + 4, 2 + 2, 1 + 1: log2(n) rounds, not n


def test_two_bad_records_of_one_batch_are_both_pinned(device):
    on_device = device({"r0": ValueError("bad"), "r3": ValueError("worse")})
    encoded, quarantined = on_device.encode([record(f"r{i}", 4) for i in range(4)])
    assert ids(encoded) == ["r1", "r2"]
    assert [q.source.id for q in quarantined] == ["r0", "r3"]


def test_a_check_that_names_its_record_quarantines_it_without_bisecting(device):
    batch = [record(f"r{i}", 4) for i in range(6)]
    failure = CheckFailed("preprocess.grid_match", "grid differs", "(1, 4, 1)", "(1, 2, 2)", image_index=0)
    failure.record = batch[2]
    on_device = device({"r2": failure})
    encoded, quarantined = on_device.encode(batch)
    assert ids(encoded) == ["r0", "r1", "r3", "r4", "r5"]
    assert [(q.source.id, q.failure.check) for q in quarantined] == [("r2", "preprocess.grid_match")]
    assert on_device.encoder.batches == [ids(batch), ["r0", "r1", "r3", "r4", "r5"]]


def test_a_check_without_its_record_is_bisected_and_keeps_its_name(device):
    on_device = device({"r1": CheckFailed("encode.finite", "NaN in the embeddings", "finite", "nan")})
    encoded, quarantined = on_device.encode([record(f"r{i}", 4) for i in range(3)])
    assert ids(encoded) == ["r0", "r2"]
    assert [(q.source.id, q.failure.check, q.failure.observed) for q in quarantined] == [("r1", "encode.finite", "nan")]


def test_an_empty_batch_never_reaches_the_tower(device):
    on_device = device({})
    assert on_device.encode([]) == ([], [])
    assert on_device.encoder.batches == []
