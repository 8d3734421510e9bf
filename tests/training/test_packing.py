"""Packing: records of a run into one checked training sequence, positions restarted and labels masked per record."""

from __future__ import annotations

from batchvlm.training import first_fit_decreasing


def test_first_fit_decreasing_puts_the_longest_first_into_the_first_bin_with_room():
    assert first_fit_decreasing([5, 7, 3, 2, 4], capacity=10) == [[1, 2], [0, 4], [3]]
