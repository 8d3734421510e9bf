"""The main process's part of the job as a chain of typed steps (datatrove's pipeline of steps, with types).

The workers' stream (executor.worker) gives, per unit, UnitStart, each record prepared (PreparedRecord) or already
quarantined (QuarantinedRecord), then UnitEnd. Each step declares the one type of item it takes and the types it
gives; every other item passes it untouched and in place, so a unit's markers reach the writer in stream order. A
step may hold items back (a batch being filled, batches in flight on the device) and gives what it still holds when
the stream ends (`end`).

    QuarantinedRecord -> Decided  -> Outcomes
    PreparedRecord    -> Batching -> Batch (records with images) | Outcomes (a record without one: nothing to encode)
    Batch             -> Encoding -> Outcomes                    (preprocessing and the tower, executor.device)
    Outcomes          -> Assembly -> Rows                        (a row per record, in the output contract)
    Rows              -> Writing                                 (to the sink's thread, counted by the tally)
    UnitStart, UnitEnd -> Opening, Closing                       (a unit opens and closes in the sink)

`Chain` checks, when it is built, that every type some step takes is given before it and that every type given is
taken by a later step: nothing falls off the end of the job unwritten. The job (executor.job) builds its chain with
`job_steps`; a benchmark that times a stage runs that stage's step `alone`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

from batchvlm.executor.batching import Batch, TokenBudgetBatcher
from batchvlm.executor.device import Device
from batchvlm.executor.rows import Assembler
from batchvlm.executor.tally import Tally
from batchvlm.records import EncodedRecord, Outcomes, PreparedRecord, QuarantinedRecord, Rows, UnitEnd, UnitStart
from batchvlm.rundir.sink import SinkWriter

WORKERS_GIVE = (UnitStart, PreparedRecord, QuarantinedRecord, UnitEnd)
"""What the workers' stream carries (executor.worker.PreparedStream)."""


class Step:
    """One step of the chain: what it takes (one type), what it gives, what it does with each item it takes, and what
    it still holds when the stream ends."""

    takes: ClassVar[type]
    gives: ClassVar[tuple[type, ...]] = ()

    def __call__(self, item: Any) -> Iterable:
        raise NotImplementedError

    def end(self) -> Iterable:
        return ()


class Decided(Step):
    """A record the workers quarantined needs no device: it is an outcome already."""

    takes, gives = QuarantinedRecord, (Outcomes,)

    def __call__(self, record: QuarantinedRecord) -> Iterator[Outcomes]:
        yield Outcomes([record])


class Batching(Step):
    """Prepared records grouped into token-budget batches; a record without images or clips is encoded as it is."""

    takes, gives = PreparedRecord, (Batch, Outcomes)

    def __init__(self, batcher: TokenBudgetBatcher):
        self.batcher = batcher

    def __call__(self, record: PreparedRecord) -> Iterator[Batch | Outcomes]:
        if not record.media_plans:
            yield Outcomes([EncodedRecord(record, [])])
        elif (closed := self.batcher.add(record)) is not None:
            yield Batch(closed)

    def end(self) -> Iterator[Batch]:
        if self.batcher.records:
            yield Batch(self.batcher.flush())


class Encoding(Step):
    """Each batch through the device stage; with runtime.overlap, a batch's outcomes come out two batches later, the
    last ones' at the end."""

    takes, gives = Batch, (Outcomes,)

    def __init__(self, device: Device):
        self.device = device

    def __call__(self, batch: Batch) -> Iterator[Outcomes]:
        if outcomes := self.device.submit(batch.records):
            yield Outcomes(outcomes)

    def end(self) -> Iterator[Outcomes]:
        if outcomes := self.device.drain():
            yield Outcomes(outcomes)


class Assembly(Step):
    """Each decided record's row: a data row, or a quarantine row with its evidence (executor.rows)."""

    takes, gives = Outcomes, (Rows,)

    def __init__(self, assembler: Assembler):
        self.assembler = assembler

    def __call__(self, outcomes: Outcomes) -> Iterator[Rows]:
        yield Rows(self.assembler.rows(outcomes.records))


class Writing(Step):
    """Rows to the sink's thread, counted by the tally (which stops a job that quarantines too much); `shown` is
    called after each (progress)."""

    takes = Rows

    def __init__(self, writer: SinkWriter, tally: Tally, shown=lambda: None):
        self.writer, self.tally, self.shown = writer, tally, shown

    def __call__(self, rows: Rows) -> tuple:
        for row in rows.rows:
            self.writer.add(row)
        self.tally.count(rows.rows)
        self.shown()
        return ()


class UnitBoundary(Step):
    """A unit's start or end handed to the writer; the progress shown after it, so that a block claimed since the last
    report is reported before its first batch."""

    def __init__(self, writer: SinkWriter, shown=lambda: None):
        self.writer, self.shown = writer, shown

    def passed(self) -> tuple:
        self.shown()
        return ()


class Opening(UnitBoundary):
    takes = UnitStart

    def __call__(self, start: UnitStart) -> tuple:
        self.writer.start_unit(start)
        return self.passed()


class Closing(UnitBoundary):
    takes = UnitEnd

    def __call__(self, end: UnitEnd) -> tuple:
        self.writer.end_unit(end)
        return self.passed()


class ChainError(TypeError):
    """Steps that do not fit: one takes what nothing gives before it, or what is given is never taken."""


class Chain:
    """Steps in order over a stream that gives `source` types, checked to fit when built; `leaves` are the types that
    may come out of its end (none for the job's, whose last steps write)."""

    def __init__(self, source: tuple[type, ...], steps: list[Step], leaves: tuple[type, ...] = ()):
        available = list(source)
        for step in steps:
            if step.takes not in available:
                raise ChainError(f"{type(step).__name__} takes {step.takes.__name__}, which nothing before it gives "
                                 f"({', '.join(kind.__name__ for kind in available)})")
            available = [kind for kind in available if kind is not step.takes] + list(step.gives)
        if left := [kind for kind in available if kind not in leaves]:
            raise ChainError(f"nothing takes {', '.join(kind.__name__ for kind in left)} at the end of the chain")
        self.steps = steps

    def __call__(self, items: Iterable) -> Iterator:
        """The stream through every step, lazily, an item at a time."""
        for step in self.steps:
            items = _through(step, items)
        return iter(items)

    def run(self, items: Iterable) -> None:
        """Drive the stream through the chain to its end (the last steps write; nothing comes out)."""
        for item in self(items):
            raise ChainError(f"{type(item).__name__} came out of the end of the chain")


def _through(step: Step, items: Iterable) -> Iterator:
    for item in items:
        if isinstance(item, step.takes):
            yield from step(item)
        else:
            yield item
    yield from step.end()


def alone(step: Step, items: Iterable) -> list:
    """One step of the job's chain run alone over items of the type it takes: a stage as a benchmark times it."""
    return list(Chain((step.takes,), [step], leaves=step.gives)(items))


def job_steps(device: Device, assembler: Assembler, batcher: TokenBudgetBatcher, writer: SinkWriter, tally: Tally,
              shown=lambda: None) -> Chain:
    """The job's chain in the main process, from the workers' stream to the sink's thread."""
    return Chain(WORKERS_GIVE, [Decided(), Batching(batcher), Encoding(device), Assembly(assembler),
                                Writing(writer, tally, shown), Opening(writer, shown), Closing(writer, shown)])
