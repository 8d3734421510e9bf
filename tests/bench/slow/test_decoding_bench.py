"""The JPEG bench on the CPU: both ways are libjpeg-turbo and give the same pixels."""

from __future__ import annotations

import pytest

from batchvlm.bench.decoding import KINDS, bench_jpeg, format_jpeg

# two photos of each kind through the isolated safe path
pytestmark = pytest.mark.slow


def test_on_the_cpu_both_ways_are_libjpeg_turbo_and_give_the_same_pixels():
    from batchvlm.bench.tasks import BenchConfig

    result = bench_jpeg(BenchConfig(task="jpeg", records=2, device="cpu"))
    assert set(result["kinds"]) == set(KINDS)
    for kind, row in result["kinds"].items():
        assert (row["max_levels"], row["share_differing"]) == (0, 0.0), kind
        assert row["safe_images_per_s"] > 0 and row["batched_images_per_s"] > 0
    assert "EXIF-rotated" in format_jpeg(result)
