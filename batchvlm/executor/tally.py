"""One rank's counts of the records it has emitted, and the rule that stops a job quarantining too much."""

from __future__ import annotations

from dataclasses import dataclass

from batchvlm.config import ChecksConfig
from batchvlm.records import OutputRow
from batchvlm.rundir.layout import QUARANTINE


class JobAborted(RuntimeError):
    """The job stopped on purpose (e.g. too many records quarantined); the message says why."""


@dataclass
class Tally:
    checks: ChecksConfig
    seen: int = 0
    quarantined: int = 0
    image_tokens: int = 0

    def count(self, rows: list[OutputRow]) -> None:
        """Count a batch's rows, then abort if the quarantined fraction is over checks.max_quarantine_fraction (once
        checks.min_records are seen)."""
        for row in rows:
            self.seen += 1
            if row.kind == QUARANTINE:
                self.quarantined += 1
            else:
                self.image_tokens += row.values["num_image_tokens"]
        limit = self.checks.max_quarantine_fraction
        if self.seen >= self.checks.min_records and self.quarantined > limit * self.seen:
            raise JobAborted(f"{self.quarantined} of {self.seen} records quarantined "
                             f"({self.quarantined / self.seen:.1%}), over checks.max_quarantine_fraction={limit}; "
                             "committed units are kept; batchvlm-report shows the reasons")
