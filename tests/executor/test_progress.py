"""Progress: a bar on a terminal; off it (Slurm, a redirect) a log line at a fixed pace, never a carriage return."""

from __future__ import annotations

import io
import logging

from batchvlm.executor.progress import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_off_a_terminal_progress_is_a_log_line_per_interval_and_one_at_the_end(caplog):
    stream, clock = io.StringIO(), Clock()
    progress = Progress(100, "embed run", enabled=True, interval_s=10, stream=stream, clock=clock)
    with caplog.at_level(logging.INFO, logger="batchvlm"):
        for second, done in ((1, 5), (9, 40), (10, 50), (15, 70), (21, 90)):
            clock.now = second
            progress.show(done)
        clock.now = 22
        progress.show(100)
        progress.close()
    assert [r.getMessage() for r in caplog.records] == [
        "embed run: 50/100 records (50%), 5.0 records/s",  # a first rate: no ETA from it alone
        "embed run: 90/100 records (90%), 4.2 records/s, eta 00:02",  # within 25% of the one before
        "embed run: 100/100 records (100%), 4.5 records/s, eta 00:00",
    ]
    assert stream.getvalue() == ""  # nothing drawn, so no '\r' reaches the log file


def test_an_unknown_total_logs_counts_and_rate_without_eta(caplog):
    clock = Clock()
    progress = Progress(None, "embed run", enabled=True, interval_s=10, stream=io.StringIO(), clock=clock)
    with caplog.at_level(logging.INFO, logger="batchvlm"):
        clock.now = 2
        progress.show(8)
        clock.now = 12
        progress.show(48)
    assert [r.getMessage() for r in caplog.records] == ["embed run: 48 records, 4.0 records/s"]


def test_the_eta_waits_for_a_stable_rate_and_never_counts_the_start_up(caplog):
    """A job that takes 19 s to start and then runs through its records in a second: no guess is ever shown."""
    clock = Clock()
    progress = Progress(100, "embed run", enabled=True, interval_s=0.5, stream=io.StringIO(), clock=clock)
    with caplog.at_level(logging.INFO, logger="batchvlm"):
        for second, done in ((19.0, 5), (19.5, 40), (20.0, 95), (20.5, 100)):
            clock.now = second
            progress.show(done)
        progress.close()
    lines = [r.getMessage() for r in caplog.records]
    assert [line for line in lines if "eta" in line] == ["embed run: 100/100 records (100%), 63.3 records/s, eta 00:00"]
    assert lines[0] == "embed run: 5/100 records (5%)"


def test_on_a_terminal_progress_is_a_bar_and_logs_nothing(caplog):
    terminal = Terminal()
    with caplog.at_level(logging.INFO, logger="batchvlm"):
        progress = Progress(10, "embed run", enabled=True, interval_s=0.001, stream=terminal)
        progress.show(10)
        progress.close()
    assert "\r" in terminal.getvalue() and "10/10" in terminal.getvalue()
    assert caplog.records == []


def test_disabled_progress_neither_draws_nor_logs(caplog):
    terminal, clock = Terminal(), Clock()
    with caplog.at_level(logging.INFO, logger="batchvlm"):
        progress = Progress(10, "embed run", enabled=False, interval_s=1, stream=terminal, clock=clock)
        clock.now = 5
        progress.show(10)
        progress.close()
    assert terminal.getvalue() == "" and caplog.records == []
