"""Token-budget batches: the worker stream's prepared records grouped until the next would pass the patch budget."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from batchvlm.records import EncodedRecord, PreparedRecord, QuarantinedRecord


@dataclass
class Batch:
    """Records whose images go to the device together."""

    records: list[PreparedRecord]


class TokenBudgetBatcher:
    """Groups records until the next one would push the batch past the patch budget."""

    def __init__(self, token_budget: int, max_images: int):
        self.token_budget, self.max_images = token_budget, max_images
        self.records: list[PreparedRecord] = []
        self.patches = 0
        self.images = 0

    def add(self, record: PreparedRecord) -> list[PreparedRecord] | None:
        """Add a record; return the batch it closes, if any."""
        full = self.records and (self.patches + record.num_patches > self.token_budget
                                 or self.images + len(record.plans) > self.max_images)
        closed = self.flush() if full else None
        self.records.append(record)
        self.patches += record.num_patches
        self.images += len(record.plans)
        return closed

    def flush(self) -> list[PreparedRecord]:
        batch, self.records, self.patches, self.images = self.records, [], 0, 0
        return batch


def batches(stream: Iterable, batcher: TokenBudgetBatcher) -> Iterator:
    """The worker stream with its records with images grouped into `Batch`es. Everything else passes through in
    place: unit markers as they are, a record already decided (quarantined in the worker, or with no image to encode)
    as a list of its one outcome."""
    for item in stream:
        if isinstance(item, QuarantinedRecord):
            yield [item]
        elif not isinstance(item, PreparedRecord):
            yield item
        elif not item.plans:
            yield [EncodedRecord(item, [])]
        elif (closed := batcher.add(item)) is not None:
            yield Batch(closed)
    if batcher.records:
        yield Batch(batcher.flush())
