"""The claims bench: claiming costs a few operations a unit, the same for four times the ranks."""

from __future__ import annotations

import pytest

from batchvlm.bench.metadata import format_claims, measure

# the claims of 2 and of 8 ranks over hundreds of units, counted
pytestmark = pytest.mark.slow


def test_claiming_costs_a_few_operations_a_unit_the_same_for_four_times_the_ranks(tmp_path):
    small, large = (measure(ranks, 64 * ranks, 8, tmp_path / f"ranks-{ranks}") for ranks in (2, 8))
    assert small["block_units"] == large["block_units"] == 8
    assert large["target"] <= 20 and large["target"] <= 1.5 * small["target"]
    assert large["per_unit"]["commit"] > 10  # the commit's own files, counted apart from the target
    assert large["per_unit"]["wait"] < 1  # a waiting rank reads its launch's board, never each unit's claims
    report = format_claims({"rows": [small, large], "units": 512})
    assert "8 ranks vs 2: " in report and report.count("\n") == 4
