"""The device side of the job: token-budget batches through preprocessing and the tower, every failure pinned on
the record that caused it (a check that knows its record names it; any other error is bisected down to the record
that raises it) while the rest of the batch is encoded unchanged, and the job stopped where a failure is its own
(tally.device_fault, tally.FailureStreak).

A batch goes through three steps: staged (its copies, `decode.jpeg=device` decode and preprocessing queued, on a side
stream on CUDA), launched (its tower queued, and its results' copies to the host behind it) and finished (one wait
for those copies, through the `Syncs` seam; then its checks and its records). With `runtime.overlap`, batch k+1 is
launched and batch k+2 staged before batch k is finished, so the device always has the next tower queued while the
host reads, checks and writes; without, each batch goes through the three steps before the next is handed in. A
batch that fails anywhere on this path is redone on the checked path (`checked`), which pins its failures.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from batchvlm.checks import CheckFailed, unexpected_failure
from batchvlm.devices import Syncs
from batchvlm.executor.overlap import Streams
from batchvlm.executor.tally import FailureStreak, device_fault
from batchvlm.faults import crash_point
from batchvlm.pipeline.encode import Launched, encode_batch, finish_batch, launch_batch
from batchvlm.pipeline.jpeg import JpegBatchDecoder
from batchvlm.pipeline.preprocess import PreprocessGuard, preprocess_batch
from batchvlm.records import EncodedRecord, Failure, PixelBatch, PreparedRecord, QuarantinedRecord

Outcome = EncodedRecord | QuarantinedRecord


def quarantined_as(record: PreparedRecord, failure: Failure) -> QuarantinedRecord:
    """A prepared record quarantined, with what preprocessing did to it so far."""
    return QuarantinedRecord(record.source, failure, record.preprocess)


@dataclass
class Staged:
    """A batch whose copies and preprocessing are queued. `batch` is None where packing raised: the batch is then
    redone on the checked path, which pins the failure on its record."""

    records: list[PreparedRecord]
    batch: PixelBatch | None
    ready: object = None  # the side stream's event after this batch (None without one)
    refused: list[QuarantinedRecord] = field(default_factory=list)  # records whose JPEG the safe path refused


@dataclass
class Running:
    """A batch whose tower and read-back are queued; `launched` is None where launching raised."""

    staged: Staged
    launched: Launched | None


def made_on_the_side(staged: Staged) -> list[torch.Tensor]:
    """What the compute stream reads of the side stream's work: the packed pixels and their finite flags, and the
    pixels decoded on the device (decode.jpeg=device), which the checked path packs again if the batch is redone."""
    decoded = [image.pixels for record in staged.records for image in record.images
               if isinstance(image.pixels, torch.Tensor)]
    batch = staged.batch
    return decoded + ([] if batch is None else [batch.pixel_values] + ([] if batch.finite is None else [batch.finite]))


@dataclass
class Device:
    preprocessor: object
    encoder: object
    guard: PreprocessGuard = field(default_factory=PreprocessGuard)
    out_dtype: torch.dtype | None = None  # the stored dtype: outputs cross to the host in it, once per batch
    overlap: bool = False
    """runtime.overlap: batch k finished only once batch k+1 is launched and k+2 staged; without, batch by batch."""
    streams: Streams = field(default_factory=lambda: Streams(torch.device("cpu")))
    jpegs: JpegBatchDecoder | None = None
    """decode.jpeg=device: decodes the JPEGs that the workers left encoded, a batch at a time, before preprocessing."""
    syncs: Syncs = field(default_factory=Syncs)
    streak: FailureStreak = field(default_factory=FailureStreak)
    staged: Staged | None = None
    running: Running | None = None
    last_error: BaseException | None = None  # the last exception the checked path caught, for the streak's message

    def submit(self, records: list[PreparedRecord]) -> list[Outcome]:
        """Hand in the next batch; get back the outcomes of the batch (or batches) finished meanwhile, in order."""
        if not self.overlap:
            return self._finish(self._launch(self._stage(records))) if records else []
        launched = self._launch(self.staged) if self.staged is not None else None
        self.staged = self._stage(records) if records else None
        done, self.running = self.running, launched
        return self._finish(done) if done is not None else []

    def drain(self) -> list[Outcome]:
        """At the end of the stream: the outcomes of every batch still in flight, and those held back by the streak."""
        outcomes = []
        while self.staged is not None or self.running is not None:
            outcomes += self.submit([])
        return outcomes + self.streak.release()

    def _stage(self, records: list[PreparedRecord]) -> Staged:
        with self.streams.staging():
            records, refused = self.jpegs(records) if self.jpegs is not None else (records, [])
            try:
                batch = preprocess_batch(records, self.preprocessor, self.guard) if records else None
            except Exception as error:  # noqa: BLE001 - redone and pinned on the checked path when its turn comes
                device_fault(error)
                batch = None
            return Staged(records, batch, self.streams.staged(), refused)

    def _launch(self, staged: Staged) -> Running:
        crash_point("encode")
        self.streams.hand_over(staged.ready, made_on_the_side(staged))
        launched = None
        if staged.batch is not None:
            self.syncs.batches += 1
            try:
                launched = launch_batch(self.encoder, staged.batch, self.out_dtype, self.streams.back)
            except Exception as error:  # noqa: BLE001 - redone and pinned on the checked path
                device_fault(error)
        return Running(staged, launched)

    def _finish(self, running: Running) -> list[Outcome]:
        staged = running.staged
        if running.launched is not None:
            try:
                return staged.refused + self.streak.judge(finish_batch(running.launched, self.syncs), None)
            except Exception as error:  # noqa: BLE001 - redone and pinned on the checked path
                device_fault(error)
        if not staged.records:
            return staged.refused
        encoded, quarantined = self.checked(staged.records)
        return staged.refused + self.streak.judge(encoded + quarantined, self.last_error)

    def checked(self, records: list[PreparedRecord]) -> tuple[list[EncodedRecord], list[QuarantinedRecord]]:
        """The checked path: encode a batch, pin every failure on the record that caused it and encode the rest
        unchanged. A CUDA error stops the job instead (tally.device_fault)."""
        if not records:
            return [], []
        crash_point("encode")
        try:
            batch = preprocess_batch(records, self.preprocessor, self.guard, self.syncs)
            return encode_batch(self.encoder, batch, self.out_dtype, self.syncs), []
        except CheckFailed as failure:
            if failure.record is not None:
                rest = [record for record in records if record is not failure.record]
                encoded, quarantined = self.checked(rest)
                return encoded, [quarantined_as(failure.record, failure.to_failure())] + quarantined
            error = failure
        except Exception as caught:  # an exception or out-of-memory: find the record that raises it
            device_fault(caught)
            error = caught
        self.last_error = error
        if len(records) == 1:
            failure = error.to_failure() if isinstance(error, CheckFailed) else unexpected_failure("encode.failed", error)
            return [], [quarantined_as(records[0], failure)]
        middle = len(records) // 2
        left, right = self.checked(records[:middle]), self.checked(records[middle:])
        return left[0] + right[0], left[1] + right[1]

