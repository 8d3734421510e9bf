"""The job's progress: a tqdm bar on a terminal, a log line every `runtime.progress_interval_s` elsewhere.

Under Slurm, or with stderr redirected to a file, a bar's carriage-return redraws land in the log as
one ever-growing line per update; a line at a fixed pace reads well in a log and costs nothing. The
rate is measured from the first records done (start-up is not work), and an ETA is shown only once
two lines' rates agree within STABLE_RATE: a first guess from a few records would be noise.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Callable, TextIO

from tqdm import tqdm

log = logging.getLogger("batchvlm")

STABLE_RATE = 0.25
"""How far apart two consecutive rates may be for the ETA to show (a fraction of the earlier)."""


class Progress:
    """Records done out of `total` (None: not known, e.g. inputs whose row counts the plan does not read),
    shown while `enabled` (rank 0 with runtime.progress)."""

    def __init__(self, total: int | None, label: str, enabled: bool, interval_s: float, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic):
        stream = stream or sys.stderr
        self.total, self.label, self.interval_s, self.clock = total, label, interval_s, clock
        self.bar = tqdm(total=total, unit="rec", desc=label, file=stream) if enabled and stream.isatty() else None
        self.logs = enabled and self.bar is None
        self.logged_at = clock()
        self.done = self.logged_done = 0
        self.first: tuple[float, int] | None = None  # (when, how many) the first records were seen done
        self.last_rate: float | None = None

    def show(self, done: int) -> None:
        if self.first is None and done > 0:
            self.first = (self.clock(), done)
        self.done = done
        if self.bar is not None:
            self.bar.n = done
            self.bar.refresh()
        elif self.logs and self.clock() - self.logged_at >= self.interval_s:
            self._log()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.logs and self.done != self.logged_done:  # the last count, even between two intervals
            self._log()

    def _log(self) -> None:
        self.logged_at, self.logged_done = self.clock(), self.done
        rate = self._rate()
        counted = (f"{self.done}/{self.total} records ({100 * self.done / self.total if self.total else 100:.0f}%)"
                   if self.total is not None else f"{self.done} records")
        line = f"{self.label}: {counted}" + (f", {rate:.1f} records/s" if rate is not None else "")
        if self.total is not None and rate and self._stable(rate):
            line += f", eta {tqdm.format_interval((self.total - self.done) / rate)}"
        self.last_rate = rate
        log.info(line)

    def _rate(self) -> float | None:
        """Records per second since the first were seen done."""
        if self.first is None:
            return None
        since, first_done = self.first
        elapsed = self.logged_at - since
        return (self.done - first_done) / elapsed if elapsed > 0 else None

    def _stable(self, rate: float) -> bool:
        return self.done >= (self.total or 0) or (
            bool(self.last_rate) and abs(rate - self.last_rate) <= STABLE_RATE * self.last_rate)
