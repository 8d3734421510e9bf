"""task=clips at tiny size: the job on LLaVA clip records beside the tower alone on the same batches, the decoder's
frames/s beside the tower's, and a long clip's peak RSS read from the job's decoder child."""

from __future__ import annotations

import pytest

from batchvlm.bench.tasks import BenchConfig
from batchvlm.config import ConfigError

TINY_CLIPS = dict(task="clips", tower="tiny", device="cpu", dtype="float32", repeats=1, clips=4, job_workers=1,
                  clip_seconds=2.0, long_clip_seconds=3.0, clip_fps=10, clip_height=56, clip_width=84,
                  long_clip_height=56, long_clip_width=84)


def test_the_clips_bench_refuses_the_released_tower_it_does_not_build():
    from batchvlm.bench.clips import clip_checkpoint

    with pytest.raises(ConfigError, match="tower=released"):
        clip_checkpoint(BenchConfig(**{**TINY_CLIPS, "tower": "released"}))
