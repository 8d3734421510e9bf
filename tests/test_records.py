"""Records: what preprocessing did to a record's images, counted once per image however often it is packed."""

from __future__ import annotations

from batchvlm.records import PreprocessStats


def test_preprocessing_counts_are_kept_by_image_so_a_repack_counts_nothing_twice():
    stats = PreprocessStats()
    for _ in range(3):  # a batch bisected or redone packs the record again
        stats.fallbacks[1] = "preprocess.grid_match"
        stats.parity_checked |= {0, 1}
        stats.parity_failed.add(1)
    assert stats.counts() == {"fallbacks": {"preprocess.grid_match": 1},
                              "parity": {"checked_images": 2, "failed_images": 1}}
