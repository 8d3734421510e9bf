"""The written data's distributions: exact percentiles, bins that hold every value once, a streamed pass."""

from __future__ import annotations

import json
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq

from batchvlm.review import distributions
from batchvlm.review.distributions import Distribution, written_distributions
from batchvlm.rundir.layout import RunLayout
from batchvlm.rundir.manifest import Listing, Manifest


def test_percentiles_are_exact_over_the_counts():
    lengths = Distribution("sequence length", "records", Counter({10: 50, 20: 40, 30: 9, 1000: 1}))
    assert lengths.percentiles() == [("p50", "10"), ("p90", "20"), ("p99", "30"), ("max", "1,000")]


def test_whole_number_bins_hold_every_value_once():
    tokens = Distribution("tokens per image", "images", Counter({value: 1 for value in range(1, 101)}))
    rows = tokens.histogram(bins=16)
    assert [count for _, _, count in rows] == [7] * 14 + [2]  # width ceil(100 / 16) = 7, so 15 bins suffice
    assert (rows[0][0], rows[-1][1] - 1) == (1, 105)
    assert [tokens.label(low, high) for low, high, _ in rows[:2]] == ["1 - 7", "8 - 14"]


def test_one_value_is_one_bin():
    tokens = Distribution("tokens per image", "images", Counter({256: 9}))
    assert tokens.histogram() == [(256, 257, 9)]
    assert tokens.label(256, 257) == "256"


def test_ratio_bins_are_equal_in_log_space_and_the_last_holds_the_max():
    aspect = Distribution("aspect ratio", "images", Counter({0.25: 1, 1.0: 5, 4.0: 1}), log_bins=True)
    assert aspect.histogram(bins=2) == [(0.25, 1.0, 1), (1.0, 4.0, 6)]


def _run_with_rows(run_dir, rows: dict) -> None:
    """A run directory with one committed data shard holding just the columns the distributions read."""
    (run_dir / "data").mkdir(parents=True)
    (run_dir / "manifest").mkdir()
    schema = pa.schema([("row", pa.int64()), ("image_num_tokens", pa.list_(pa.int32())),
                        ("token_tags", pa.list_(pa.int8())), ("original_size", pa.list_(pa.list_(pa.int32(), 2)))])
    rows = {"row": list(range(len(rows["token_tags"]))), **rows}
    pq.write_table(pa.table(rows, schema=schema), run_dir / "data" / "u.parquet")
    count = len(rows["row"])
    manifest = Manifest("u", "input", 0, count, count, count, 0, {},
                        {"data": [Listing("data/u.parquet", count, 0, "")]},
                        rank=0, claim="a0")
    (run_dir / "manifest" / "u.json").write_text(json.dumps(manifest.to_json()))


def test_written_distributions_count_images_and_records_and_keep_thin_strips_apart(tmp_path):
    _run_with_rows(tmp_path, {"image_num_tokens": [[5, 7], [], [5]], "token_tags": [[1] * 20, [0] * 4, [0] * 9],
                              "original_size": [[[1, 3000], [3000, 1]], [], [[480, 640]]]})
    tokens, lengths, aspect = written_distributions(RunLayout(tmp_path))
    assert tokens.counts == Counter({5: 2, 7: 1})
    assert lengths.counts == Counter({20: 1, 4: 1, 9: 1})  # the text-only record counts as a sequence
    ratios = sorted(aspect.counts)
    assert aspect.total == 3 and len(ratios) == 3
    assert ratios[0] < 1 / 2900 and abs(ratios[1] - 4 / 3) < 1e-3 and ratios[2] > 2900


def test_a_run_with_no_written_record_has_empty_distributions(tmp_path):
    _run_with_rows(tmp_path, {"image_num_tokens": [], "token_tags": [], "original_size": []})
    assert [distribution.total for distribution in written_distributions(RunLayout(tmp_path))] == [0, 0, 0]


def test_later_occurrences_of_an_id_are_left_out_as_read_run_leaves_them(tmp_path, monkeypatch):
    _run_with_rows(tmp_path, {"image_num_tokens": [[5], [7], [9]], "token_tags": [[0] * 3, [0] * 4, [0] * 5],
                              "original_size": [[[10, 10]], [[10, 20]], [[10, 40]]]})
    monkeypatch.setattr(distributions, "excluded_rows", lambda layout: {"u": {1}})  # the duplicate pass's list
    tokens, lengths, aspect = written_distributions(RunLayout(tmp_path))
    assert (tokens.counts, lengths.counts) == (Counter({5: 1, 9: 1}), Counter({3: 1, 5: 1}))
    assert sorted(aspect.counts) == [1.0, 4.0]
