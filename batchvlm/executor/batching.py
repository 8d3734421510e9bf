"""Token-budget batches: prepared records grouped until the next would pass the patch budget (steps.Batching)."""

from __future__ import annotations

from dataclasses import dataclass

from batchvlm.records import PreparedRecord


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
                                 or self.images + len(record.media_plans) > self.max_images)
        closed = self.flush() if full else None
        self.records.append(record)
        self.patches += record.num_patches
        self.images += len(record.media_plans)
        return closed

    def flush(self) -> list[PreparedRecord]:
        batch, self.records, self.patches, self.images = self.records, [], 0, 0
        return batch

