"""The device side of the job: token-budget batches through preprocessing and the tower, every failure pinned on
the record that caused it (a check that knows its record names it; any other error is bisected down to the record
that raises it) while the rest of the batch is encoded unchanged.

With `runtime.overlap`, batch k+1 is staged (its copies, `decode.jpeg=device` decode and preprocessing, on a side
stream on CUDA) while batch k encodes; a batch that fails anywhere on that path is redone on the checked path.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from batchvlm.checks import CheckFailed, unexpected_failure
from batchvlm.executor.batching import Batch
from batchvlm.executor.overlap import Streams
from batchvlm.faults import crash_point
from batchvlm.pipeline.encode import encode_batch, finish_batch, start_batch
from batchvlm.pipeline.jpeg import JpegBatchDecoder
from batchvlm.pipeline.preprocess import PreprocessGuard, preprocess_batch
from batchvlm.records import EncodedRecord, Failure, PixelBatch, PreparedRecord, QuarantinedRecord


def quarantined_as(record: PreparedRecord, failure: Failure) -> QuarantinedRecord:
    """A prepared record quarantined, with what preprocessing did to it so far."""
    return QuarantinedRecord(record.source, failure, record.preprocess)


@dataclass
class Staged:
    """Batch k+1, its copies and preprocessing queued on the side stream while batch k encodes. `batch` is None
    where packing raised: the batch is then redone on the checked path, which pins the failure on its record."""

    records: list[PreparedRecord]
    batch: PixelBatch | None
    ready: object = None  # the side stream's event after this batch (None on the CPU)
    refused: list[QuarantinedRecord] = field(default_factory=list)  # records whose JPEG the safe path refused


def made_on_the_side(staged: Staged) -> list[torch.Tensor]:
    """What the compute stream reads of the side stream's work: the packed pixels, and the pixels decoded on the
    device (decode.jpeg=device), which the checked path packs again if the batch is redone."""
    decoded = [image.pixels for record in staged.records for image in record.images
               if isinstance(image.pixels, torch.Tensor)]
    return decoded + ([staged.batch.pixel_values] if staged.batch is not None else [])


@dataclass
class Device:
    preprocessor: object
    encoder: object
    guard: PreprocessGuard = field(default_factory=PreprocessGuard)
    out_dtype: torch.dtype | None = None  # the stored dtype: outputs cross to the host in it, once per batch
    streams: Streams | None = None
    """runtime.overlap: with streams, `submit` stages batch k+1 while batch k encodes; without, batch by batch."""
    jpegs: JpegBatchDecoder | None = None
    """decode.jpeg=device: decodes the JPEGs that the workers left encoded, a batch at a time, before preprocessing."""

    def submit(self, pending: Staged | None, records: list[PreparedRecord]) -> tuple[
            list[EncodedRecord], list[QuarantinedRecord], Staged | None]:
        """Hand in the next batch (empty at the end of the stream); get back the results of the batch handed in
        before it and the batch now pending. Without streams the batch is encoded at once and nothing is pending.

        Order, with streams: batch k's tower is queued, then batch k+1 is staged on the side stream (its pack reads
        its checks back with a sync of the side stream alone), then batch k's checks and copy to the host wait for
        the tower. A batch that fails anywhere on this path is redone on the checked path (`encode`), so its
        failures are pinned and bisected exactly as without overlap."""
        if self.streams is None:
            records, refused = self._decoded(records)
            encoded, quarantined = self.encode(records)
            return encoded, refused + quarantined, None
        outputs = self._launch(pending) if pending is not None else None
        staged = self._stage(records) if records else None
        if pending is None:
            return [], [], staged
        encoded, quarantined = self._finish(pending, outputs)
        return encoded, pending.refused + quarantined, staged

    def _decoded(self, records: list[PreparedRecord]) -> tuple[list[PreparedRecord], list[QuarantinedRecord]]:
        return self.jpegs(records) if self.jpegs is not None else (records, [])

    def _stage(self, records: list[PreparedRecord]) -> Staged:
        with self.streams.staging():
            records, refused = self._decoded(records)
            try:
                batch = preprocess_batch(records, self.preprocessor, self.guard)
            except Exception:  # noqa: BLE001 - redone and pinned on the checked path when the batch's turn comes
                batch = None
            return Staged(records, batch, self.streams.staged(), refused)

    def _launch(self, staged: Staged) -> dict | None:
        crash_point("encode")
        self.streams.hand_over(staged.ready, made_on_the_side(staged))
        if staged.batch is None:
            return None
        try:
            return start_batch(self.encoder, staged.batch)
        except Exception:  # noqa: BLE001 - redone and pinned on the checked path
            return None

    def _finish(self, staged: Staged, outputs: dict | None) -> tuple[list[EncodedRecord], list[QuarantinedRecord]]:
        if outputs is not None:
            try:
                return finish_batch(self.encoder, staged.batch, outputs, self.out_dtype), []
            except Exception:  # noqa: BLE001 - redone and pinned on the checked path
                pass
        return self.encode(staged.records)

    def encode(self, records: list[PreparedRecord]) -> tuple[list[EncodedRecord], list[QuarantinedRecord]]:
        """The checked path: encode a batch, pin every failure on the record that caused it and encode the rest
        unchanged."""
        if not records:
            return [], []
        crash_point("encode")
        try:
            batch = preprocess_batch(records, self.preprocessor, self.guard)
            return encode_batch(self.encoder, batch, self.out_dtype), []
        except CheckFailed as failure:
            if failure.record is not None:
                rest = [record for record in records if record is not failure.record]
                encoded, quarantined = self.encode(rest)
                return encoded, [quarantined_as(failure.record, failure.to_failure())] + quarantined
            error = failure
        except Exception as caught:  # an exception or out-of-memory: find the record that raises it
            error = caught
        if len(records) == 1:
            failure = error.to_failure() if isinstance(error, CheckFailed) else unexpected_failure("encode.failed", error)
            return [], [quarantined_as(records[0], failure)]
        middle = len(records) // 2
        left, right = self.encode(records[:middle]), self.encode(records[middle:])
        return left[0] + right[0], left[1] + right[1]


def encoded(items: Iterable, device: Device) -> Iterator:
    """Each `Batch` of the stream through the device, out as the list of its records' outcomes (encoded or
    quarantined); with overlap, a batch's outcomes come out when the next batch is handed in, the last one's at the
    end. Everything else passes through in place."""
    pending = None
    for item in items:
        if isinstance(item, Batch):
            done, failed, pending = device.submit(pending, item.records)
            if done or failed:
                yield done + failed
        else:
            yield item
    done, failed, _ = device.submit(pending, [])
    if done or failed:
        yield done + failed
