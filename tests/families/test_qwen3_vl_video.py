"""Qwen3-VL clips sampled, sized and timed by batchvlm's rule, against transformers' own Qwen3VLVideoProcessor and
Qwen3VLProcessor (the rule's named reference, families.qwen2_vl.QWEN3_VIDEO_RULE), its positions against the model's
get_rope_index and its tokens (with the deepstack features) against the model's get_video_features."""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers import Qwen3VLVideoProcessor

from batchvlm.checks import CheckFailed
from batchvlm.families.qwen2_vl import (QWEN3_VIDEO_RULE, QwenProcessorParams, Qwen3VideoParams,
                                       qwen3_sample_frames, qwen3_video_plan)
from batchvlm.format.layouts import MERGE_WINDOW, PatchLayout
from batchvlm.pipeline.preprocess import frame_rows
from batchvlm.pipeline.video import VideoConfig, decode_frames, probe
from clips import make_clip
from test_qwen2_vl_video import hf_processor as video_processor
from test_qwen2_vl_video import metadata

PARAMS = QwenProcessorParams(patch_size=16, image_mean=(0.5,) * 3, image_std=(0.5,) * 3)
LAYOUT = PatchLayout(MERGE_WINDOW, PARAMS.patch_size, PARAMS.merge_size, PARAMS.temporal_patch_size)
SMALL = Qwen3VideoParams(min_pixels=32 * 32 * 16, max_pixels=32 * 32 * 64, max_video_tokens=64)
"""A checkpoint's video processor config as a small one would ship it: frames of about 130x130 pixels."""


def hf_processor(video: Qwen3VideoParams, params: QwenProcessorParams = PARAMS) -> Qwen3VLVideoProcessor:
    return video_processor(video, params, Qwen3VLVideoProcessor)


@pytest.mark.parametrize("video", [Qwen3VideoParams(), Qwen3VideoParams(fps=1.0, min_frames=2, max_frames=16),
                                   Qwen3VideoParams(fps=4.5, min_frames=5, max_frames=41)])
def test_the_sampled_frames_are_the_qwen3_video_processors_over_lengths_and_rates(video):
    processor = hf_processor(video)
    for total, video_fps in itertools.product([2, 3, 5, 7, 30, 31, 97, 301, 1999], [1, 7.5, 24, 29.97, 60]):
        ours = qwen3_sample_frames(total, video_fps, PARAMS, video)
        theirs = processor.sample_frames(metadata(total, video_fps)).tolist()
        assert ours == theirs, (total, video_fps)


def test_a_qwen3_clip_of_one_frame_is_too_few_frames():
    """The processor's smart_resize raises on fewer frames than one temporal patch; the job names the check."""
    with pytest.raises(CheckFailed, match="video.too_few_frames"):
        qwen3_sample_frames(1, 24.0, PARAMS, Qwen3VideoParams())


@pytest.mark.parametrize("frames, video_fps, height, width, video", [
    (30, 10, 64, 96, Qwen3VideoParams()),  # the research notes' worked clip: [3, 8, 12] (qwen-vl-utils: [3, 20, 28])
    (31, 10, 64, 96, SMALL),  # linspace picks 7 frames of 31: an odd count, its last frame repeated in the rows
    (45, 15, 90, 160, Qwen3VideoParams(fps=6.0)),
    (40, 25, 200, 120, Qwen3VideoParams(min_pixels=32 * 32 * 8, max_pixels=32 * 32 * 400)),  # max_pixels shared
    (12, 4, 20, 150, SMALL),  # a frame under one factor is scaled up first
])
def test_grids_pixels_and_timestamps_of_a_decoded_clip_match_qwen3s_processors(frames, video_fps, height, width,
                                                                               video):
    from transformers import Qwen3VLProcessor

    data = make_clip(frames, fps=video_fps, height=height, width=width)
    limits = VideoConfig()
    header = probe(data, limits)
    indices = qwen3_sample_frames(header.frames, header.fps, PARAMS, video)
    clip = decode_frames(data, header, indices, limits)
    plan = qwen3_video_plan(indices, list(clip.timestamps_s), header.frames, header.fps, *clip.frames.shape[1:3],
                            PARAMS, video)

    everything = decode_frames(data, header, list(range(header.frames)), limits).frames
    reference = hf_processor(video)(videos=[torch.from_numpy(everything).permute(0, 3, 1, 2)],
                                    video_metadata=[metadata(frames, video_fps, height, width)], return_tensors="pt",
                                    return_metadata=True)
    sampled = reference["video_metadata"][0].frames_indices
    assert list(plan.indices) == sampled.tolist()
    assert [list(plan.grid_thw)] == reference["video_grid_thw"].tolist()
    assert plan.num_tokens == reference["pixel_values_videos"].shape[0] // 4
    rows = frame_rows(torch.from_numpy(clip.frames), plan.resized, LAYOUT, PARAMS, "bicubic")
    assert rows.shape == reference["pixel_values_videos"].shape
    torch.testing.assert_close(rows, reference["pixel_values_videos"], atol=1e-5, rtol=0)
    # the timestamps the processor writes (from index / fps) are the plan's (from the pts), as text
    theirs = Qwen3VLProcessor._calculate_timestamps(None, sampled, video_fps, PARAMS.temporal_patch_size)
    assert [f"{t:.1f}" for t in plan.timestamps] == [f"{t:.1f}" for t in theirs]
    assert plan.timestamps == pytest.approx(theirs)
    assert [span.grid_thw for span in plan.spans] == [(1, *plan.grid_thw[1:])] * plan.grid_thw[0]


def test_the_worked_clip_takes_the_processors_grid_not_qwen_vl_utils():
    """The divergence the rule picks a side of: the minimum holds the whole clip, not each frame."""
    indices = qwen3_sample_frames(30, 10.0, PARAMS, Qwen3VideoParams())
    plan = qwen3_video_plan(indices, [i / 10 for i in indices], 30, 10.0, 64, 96, PARAMS, Qwen3VideoParams())
    assert plan.grid_thw == (3, 8, 12) and "Qwen3VLVideoProcessor" in QWEN3_VIDEO_RULE
