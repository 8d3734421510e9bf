"""The tally: rows counted by kind and image tokens, and the job stopped once too much is quarantined."""

from __future__ import annotations

import pytest

from batchvlm.config import ChecksConfig
from batchvlm.executor.tally import JobAborted, Tally
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
