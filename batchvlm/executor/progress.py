"""The job's progress: a tqdm bar on a terminal, a log line every `runtime.progress_interval_s` elsewhere.

Under Slurm, or with stderr redirected to a file, a bar's carriage-return redraws land in the log as
one ever-growing line per update; a line at a fixed pace reads well in a log and costs nothing.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Callable, TextIO

from tqdm import tqdm

log = logging.getLogger("batchvlm")


class Progress:
    """Records done out of `total` (None: not known, e.g. inputs whose row counts the plan does not read),
    shown while `enabled` (rank 0 with runtime.progress)."""

    def __init__(self, total: int | None, label: str, enabled: bool, interval_s: float, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic):
        stream = stream or sys.stderr
        self.total, self.label, self.interval_s, self.clock = total, label, interval_s, clock
        self.bar = tqdm(total=total, unit="rec", desc=label, file=stream) if enabled and stream.isatty() else None
        self.logs = enabled and self.bar is None
        self.started = self.logged_at = clock()
        self.done = self.logged_done = 0

    def show(self, done: int) -> None:
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
        elapsed = self.logged_at - self.started
        rate = self.done / elapsed if elapsed > 0 else 0.0
        if self.total is None:
            log.info("%s: %d records, %.1f records/s", self.label, self.done, rate)
            return
        eta = tqdm.format_interval((self.total - self.done) / rate) if rate > 0 else "?"
        log.info("%s: %d/%d records (%.0f%%), %.1f records/s, eta %s", self.label, self.done, self.total,
                 100 * self.done / self.total if self.total else 100, rate, eta)
