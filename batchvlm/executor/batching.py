"""Token-budget batches: prepared records grouped until the next would pass the patch budget (steps.Batching).

A record weighs the patches of its images and of its clips (a clip's `t x h x w`, every frame the tower sees): the
tower's cost grows with them alike, since a Qwen2/2.5-VL tower attends within each temporal patch of a clip as within
an image. A record whose patches alone pass the budget is not cut (a clip's tokens come out of one record's row): it
is a batch of its own, between the batches before and after it, and the log names it, its clips and the budget, so
that a run whose clips keep passing it can raise `preprocess.token_budget` or lower the clips' pixels.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from batchvlm.records import PreparedRecord

log = logging.getLogger("batchvlm")


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
        if record.num_patches > self.token_budget:
            self._name_over_budget(record)
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

    def _name_over_budget(self, record: PreparedRecord) -> None:
        clips = ", ".join(f"clip {k}: {plan.num_patches}" for k, plan in enumerate(record.clip_plans))
        log.warning("record %s holds %d patches%s, over preprocess.token_budget=%d: it is encoded alone, in a batch "
                    "over the budget", record.source.id, record.num_patches, f" ({clips})" if clips else "",
                    self.token_budget)
