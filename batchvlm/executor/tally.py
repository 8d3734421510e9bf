"""One rank's counts of the records it has emitted, and the rules that stop a job: too much quarantined, or a failure
that is the job's own and not its records'."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from batchvlm.config import Config, ConfigError, operational
from batchvlm.devices import is_device_fault
from batchvlm.records import OutputRow, QuarantinedRecord
from batchvlm.rundir.layout import QUARANTINE


@dataclass
class ChecksConfig(Config):
    KEY: ClassVar[str] = "checks"

    max_quarantine_fraction: float = operational(0.5)
    """Abort the job once this fraction of records is quarantined (after min_records)."""
    min_records: int = operational(100)
    """Records seen before the quarantine fraction can abort the job."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.max_quarantine_fraction <= 1.0:
            raise ConfigError(f"checks.max_quarantine_fraction={self.max_quarantine_fraction} must be in [0, 1]")
        if self.min_records < 0:
            raise ConfigError("checks.min_records must be >= 0")


class JobAborted(RuntimeError):
    """The job stopped on purpose (e.g. too many records quarantined); the message says why."""


class SystematicFailure(JobAborted):
    """The job stopped on an error that is its own (a dtype or device mismatch, a CUDA error), not its records'."""


class QuarantineOverLimit(JobAborted):
    """The run is complete, but it quarantined more than checks.max_quarantine_fraction of its records."""

    def __init__(self, message: str, summary: dict):
        super().__init__(message)
        self.summary = summary


def over_limit(quarantined: int, seen: int, checks: ChecksConfig) -> str | None:
    """Why `quarantined` of `seen` records is too many, or None."""
    limit = checks.max_quarantine_fraction
    if seen and quarantined > limit * seen:
        return (f"{quarantined} of {seen} records quarantined ({quarantined / seen:.1%}), over "
                f"checks.max_quarantine_fraction={limit}")
    return None


def check_run_totals(summary: dict, checks: ChecksConfig) -> None:
    """A finished run whose totals are over the quarantine limit ends non-zero, however few its records (the limit
    stops a running job only once checks.min_records are seen)."""
    if reason := over_limit(summary["quarantined"], summary["records_in"], checks):
        raise QuarantineOverLimit(f"{reason}; the run is complete and committed; batchvlm-report shows the reasons",
                                  summary)


def device_fault(error: BaseException) -> None:
    """Stop the job on a CUDA error: sticky (every later call fails) or the job's own, it is never pinned on a
    record."""
    if is_device_fault(error):
        raise SystematicFailure(f"a CUDA error, not a fault of any record: {type(error).__name__}: {error}") from error


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
                self.image_tokens += row.values["num_image_tokens"] + sum(row.values.get("video_num_tokens") or ())
        reason = over_limit(self.quarantined, self.seen, self.checks)
        if self.seen >= self.checks.min_records and reason:
            raise JobAborted(f"{reason}; committed units are kept; batchvlm-report shows the reasons")


@dataclass
class FailureStreak:
    """The rule that stops a job failing the same way on every record.

    When bisection ends with every record of a batch quarantined under the same exception, class and message, it may
    be the job's own fault (a dtype or device mismatch), which bisection would pin on each record in turn. That batch's
    records are held back; if every record of the next batch fails the same way, the job stops with the error and
    they are never quarantined; otherwise they are released, quarantined as they were."""

    held: list[QuarantinedRecord] = field(default_factory=list)
    signature: str | None = None

    def judge(self, outcomes: list, error: BaseException | None) -> list:
        """A finished batch's outcomes (`error`: the last exception its bisection caught): those to emit now."""
        signature = uniform_failure(outcomes)
        if signature is not None and signature == self.signature:
            raise SystematicFailure(f"every record of two batches in a row failed with {signature}: a fault of the "
                                    "job (its dtype, its device, its code), not of the records; none was "
                                    "quarantined for it") from error
        released, self.signature = self.held, signature
        self.held = outcomes if signature is not None else []
        return released + (outcomes if signature is None else [])

    def release(self) -> list:
        """At the end of the stream: the held records, quarantined after all (no next batch to judge them by)."""
        released, self.held, self.signature = self.held, [], None
        return released


def uniform_failure(outcomes: list) -> str | None:
    """`<exception>: <message>` where every record failed with one exception that no check anticipated."""
    failures = [outcome.failure for outcome in outcomes if isinstance(outcome, QuarantinedRecord)]
    if not outcomes or len(failures) < len(outcomes):
        return None
    messages = {(failure.check, failure.message) for failure in failures}
    check, message = next(iter(messages))
    return message if len(messages) == 1 and check == "encode.failed" else None
