"""Rows: each record's outcome (encoded or quarantined) as the row its unit's shard of that kind takes."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from batchvlm.checks import CheckFailed
from batchvlm.pipeline.assemble import data_row, quarantine_row
from batchvlm.records import EncodedRecord, OutputRow, QuarantinedRecord
from batchvlm.rundir.layout import DATA, QUARANTINE

log = logging.getLogger("batchvlm")


@dataclass(frozen=True)
class Assembler:
    """What a row needs beyond its record: the stored dtype and hidden sizes, the quarantine's cap on image bytes and
    the run's fingerprint."""

    embed_dtype: torch.dtype
    hidden_sizes: dict[str, int]
    quarantine_bytes_cap: int
    fingerprint: str
    train_on: str = "all"  # text.train_on, resolved: what assemble.loss_mask allows
    placeholder: str = "<image>"  # how a quarantined conversation's images show in its turns

    def rows(self, outcomes: list[EncodedRecord | QuarantinedRecord]) -> list[OutputRow]:
        data, quarantined = [], []
        for outcome in outcomes:
            if isinstance(outcome, QuarantinedRecord):
                quarantined.append(outcome)
                continue
            try:
                data.append(OutputRow(outcome.prepared.source, DATA,
                                      data_row(outcome, self.embed_dtype, self.hidden_sizes, self.train_on),
                                      outcome.prepared.preprocess.counts()))
            except CheckFailed as failure:
                quarantined.append(QuarantinedRecord(outcome.prepared.source, failure.to_failure(),
                                                     outcome.prepared.preprocess))
        return data + [self._quarantine_row(item) for item in quarantined]

    def _quarantine_row(self, item: QuarantinedRecord) -> OutputRow:
        log.warning("quarantined %s [%s] %s", item.source.id, item.failure.check, item.failure.message)
        return OutputRow(item.source, QUARANTINE, quarantine_row(item, self.quarantine_bytes_cap, self.fingerprint,
                                                                 self.placeholder),
                         item.preprocess.counts())

