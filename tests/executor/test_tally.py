"""The tally: rows counted by kind and image tokens, and the job stopped once too much is quarantined (while it runs,
and when it ends) or on a CUDA error (devices.is_device_fault)."""

from __future__ import annotations

import pytest
import torch

from batchvlm.executor.tally import ChecksConfig
from batchvlm.executor.tally import (JobAborted, QuarantineOverLimit, SystematicFailure, Tally, check_run_totals,
                                     device_fault)
from batchvlm.records import OutputRow, SourceRecord
from batchvlm.rundir.layout import DATA, QUARANTINE


def rows(*kinds: str) -> list[OutputRow]:
    source = SourceRecord("r", "u", "s", 0, "", [])
    return [OutputRow(source, kind, {"num_image_tokens": 4} if kind == DATA else {}, {}) for kind in kinds]


def test_rows_are_counted_by_kind_with_their_image_tokens():
    tally = Tally(ChecksConfig())
    tally.count(rows(DATA, QUARANTINE, DATA))
    assert (tally.seen, tally.quarantined, tally.image_tokens) == (3, 1, 8)


def test_a_high_quarantined_fraction_aborts_only_once_enough_records_are_seen():
    tally = Tally(ChecksConfig(max_quarantine_fraction=0.5, min_records=4))
    tally.count(rows(QUARANTINE, QUARANTINE, QUARANTINE))  # 3 of 3, but too few seen to judge
    with pytest.raises(JobAborted, match=r"4 of 4 records quarantined .*max_quarantine_fraction=0.5"):
        tally.count(rows(QUARANTINE))


def test_a_fraction_at_the_limit_goes_on():
    tally = Tally(ChecksConfig(max_quarantine_fraction=0.5, min_records=2))
    tally.count(rows(QUARANTINE, DATA, QUARANTINE, DATA))
    assert tally.quarantined == 2


def test_a_finished_run_over_the_quarantine_limit_fails_however_few_its_records():
    summary = {"records_in": 21, "quarantined": 3}
    check_run_totals(summary, ChecksConfig(max_quarantine_fraction=0.5))  # 14% is within the default
    with pytest.raises(QuarantineOverLimit, match=r"3 of 21 records quarantined \(14.3%\), over "
                                                  r"checks.max_quarantine_fraction=0.1; the run is complete") as over:
        check_run_totals(summary, ChecksConfig(max_quarantine_fraction=0.1, min_records=100))
    assert over.value.summary is summary


def test_cuda_errors_stop_the_job_and_out_of_memory_does_not():
    device_fault(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))  # a record's: bisected
    device_fault(ValueError("bad image"))
    for message in ("CUDA error: an illegal memory access was encountered", "CUDA error: device-side assert triggered",
                    "CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx(...)`"):
        with pytest.raises(SystematicFailure, match="a CUDA error, not a fault of any record"):
            device_fault(RuntimeError(message))
