"""task=clips run: the job and the decoder beside the tower, and the decoder's peak RSS."""

from __future__ import annotations

import pytest

from batchvlm.bench.tasks import BenchConfig
from test_clips_bench import TINY_CLIPS

# the clips bench runs the job
pytestmark = pytest.mark.slow


def test_the_clips_bench_puts_the_job_and_the_decoder_beside_the_tower_and_reads_the_decoders_peak_rss():
    from batchvlm.bench.clips import bench_clips, format_clips

    result = bench_clips(BenchConfig(**TINY_CLIPS))
    # 20 frames at 10 fps: Qwen2-VL's 2 a second, 4 a clip, decoded through frame 15; a 4 x 6 patch grid per frame
    assert (result["sampled"], result["decoded"], result["grid"]) == (16, 64, [2, 4, 6])
    assert result["patches"] == 4 * 2 * 4 * 6 and result["batches"] == 1  # well under the default token budget
    assert min(result[key] for key in ("decode_frames_per_s", "tower_frames_per_s", "tower_clips_per_s",
                                       "job_clips_per_s")) > 0
    assert result["decode_decoded_per_s"] == result["decode_frames_per_s"] * 64 / 16
    assert result["long_sampled"] == 6 and result["long_bytes"] == 6 * 56 * 84 * 3
    assert result["decoder_peak_mb"] >= result["decoder_before_mb"] > 0
    report = format_clips(result)
    assert "end-to-end" in report and "clips/s" in report and "job's decoder child at a peak RSS" in report
    assert "tiny Qwen2-VL tower in float32 on cpu" in report
