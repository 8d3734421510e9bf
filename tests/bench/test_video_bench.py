"""task=video on a small clip: every figure is there and the sampled frames are Qwen2-VL's, as rows."""

from __future__ import annotations

import math

from batchvlm.bench.tasks import BenchConfig
from batchvlm.bench.video import bench_video, format_video


def test_the_video_bench_decodes_samples_and_lays_out_a_clip():
    config = BenchConfig(task="video", repeats=1, clip_seconds=2.0, long_clip_seconds=3.0, clip_fps=10, clip_height=56, clip_width=84)
    result = bench_video(config)
    assert (result["frames"], result["sampled"], result["last"]) == (20, 4, 15)
    assert result["sampled_bytes"] == 4 * 56 * 84 * 3 and result["rows"][0] == math.prod(result["grid"])
    assert result["grid"][0] == 2  # 4 frames: two temporal patches
    assert result["long_sampled"] == 6 and result["peak_mb"] >= result["start_mb"] > 0
    assert result["all_frames"] == "not refused"  # 30 small frames are well under the cap
    assert 0 < result["rotation_s"] < result["all_s"]  # one frame decoded, not twenty
    report = format_video(result)
    assert "20 frames at 10 fps" in report and "frames/s" in report
