"""SigLIP2 clips (issue 31): frames sampled as transformers' SmolVLMVideoProcessor samples them (VIDEO_RULE), each
frame planned and laid out as Siglip2ImageProcessor gives it under the clip's own max_num_patches, and a clip packed
with an image through the tower as batchvlm loads it against the model's own forward on each frame."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import Siglip2ImageProcessor, SmolVLMVideoProcessor
from transformers.video_utils import VideoMetadata

from clips import make_clip

from batchvlm.families import ModelConfig, load_family
from batchvlm.families.siglip2 import VIDEO_PROCESSOR_CONFIG, SiglipVideoParams, siglip_sample_frames
from batchvlm.format.schema import FRAME, VIDEO
from batchvlm.pipeline.preprocess import frame_rows
from batchvlm.pipeline.video import VideoConfig, decode_clip

CLIP_PATCHES = 64
"""The clip's own patch budget (video_preprocessor_config.json), a quarter of the images' 256."""


@pytest.fixture(scope="module")
def siglip(tmp_path_factory):
    """The tiny checkpoint with a video processor config: 2 frames a second, at most 6, 64 patches a frame."""
    folder = tmp_path_factory.mktemp("siglip2_video")
    shutil.copytree(load_family(ModelConfig(family="siglip2")).checkpoint, folder, dirs_exist_ok=True)
    (folder / VIDEO_PROCESSOR_CONFIG).write_text(json.dumps({"fps": 2.0, "max_frames": 6,
                                                              "max_num_patches": CLIP_PATCHES}))
    return load_family(ModelConfig(family="siglip2", path=str(folder)))


@pytest.mark.parametrize("fps,max_frames,skip_secs", [(1.0, 64, 1.0), (2.0, 8, 1.0), (0.5, 3, 0.0), (4.0, 16, 2.0)])
def test_frames_are_sampled_as_smolvlms_video_processor_samples_them(fps, max_frames, skip_secs):
    """Over clip lengths and rates (one frame to minutes, fractional rates), the frames SmolVLMVideoProcessor's
    sample_frames picks, on the metadata transformers' decoders give it (duration = frames / fps)."""
    params = SiglipVideoParams(fps=fps, max_frames=max_frames, skip_secs=skip_secs)
    reference = SmolVLMVideoProcessor()
    for total in (1, 2, 3, 7, 31, 60, 61, 250, 1801, 4001):
        for video_fps in (1.0, 2.5, 10.0, 23.976, 30.0, 60.0):
            metadata = VideoMetadata(total_num_frames=total, fps=video_fps, duration=total / video_fps)
            expected = reference.sample_frames(metadata, num_frames=max_frames, fps=fps, skip_secs=skip_secs)
            assert siglip_sample_frames(total, video_fps, params) == expected.tolist(), (total, video_fps)


def test_the_clip_rule_and_its_parameters_are_read_from_the_checkpoint(siglip):
    assert siglip.video_params == SiglipVideoParams(fps=2.0, max_frames=6, skip_secs=1.0, max_num_patches=CLIP_PATCHES)
    default = load_family(ModelConfig(family="siglip2"))
    assert default.video_params.max_num_patches == default.params.max_num_patches  # the images' where none is stated
    assert siglip.video_fingerprint()["params"]["max_num_patches"] == CLIP_PATCHES
    assert "SmolVLMVideoProcessor" in siglip.video_fingerprint()["rule"]


@pytest.mark.parametrize("frames,fps,height,width", [(31, 10, 64, 96), (7, 3, 150, 40), (1, 25, 48, 48)])
def test_each_frame_is_planned_and_laid_out_as_siglip2s_image_processor_gives_it(siglip, frames, fps, height, width):
    """Grid (frames, h, w) and each frame's rows == Siglip2ImageProcessor(max_num_patches=the clip's) on that decoded
    frame (its padded rows cut to the frame's), to float rounding."""
    clip = decode_clip(make_clip(frames, fps=fps, height=height, width=width), VideoConfig(), siglip.video_sampler())
    decoded = clip.decoded
    plan = siglip.plan_video(list(decoded.indices), clip.header.frames, clip.header.fps, *decoded.frames.shape[1:3])
    reference = Siglip2ImageProcessor(patch_size=16, max_num_patches=CLIP_PATCHES, image_mean=[0.5] * 3,
                                      image_std=[0.5] * 3)
    out = reference(images=[torch.from_numpy(frame).permute(2, 0, 1) for frame in decoded.frames],
                    return_tensors="pt")
    (h, w), = {tuple(shape) for shape in out["spatial_shapes"].tolist()}
    assert plan.grid_thw == (len(decoded.indices), h, w) and plan.num_tokens == len(decoded.indices) * h * w
    rows = frame_rows(torch.from_numpy(decoded.frames), plan.resized, siglip.layout, siglip, siglip.resample)
    expected = out["pixel_values"][:, :h * w].reshape(-1, out["pixel_values"].shape[-1])
    assert rows.shape == expected.shape
    assert float((rows - expected).abs().max()) < 1e-5


def test_a_clip_is_one_span_of_clip_tokens_framed_as_an_image(siglip):
    clip = decode_clip(make_clip(20, fps=10), VideoConfig(), siglip.video_sampler())
    plan = siglip.plan_video(list(clip.decoded.indices), clip.header.frames, clip.header.fps, 64, 96)
    ids, tags = siglip.expand_video(plan)
    assert ids == [*siglip.frame_ids[:1], *[siglip.video_token_id] * plan.num_tokens, *siglip.frame_ids[1:]]
    assert tags == [FRAME, *[VIDEO] * plan.num_tokens, FRAME]
    assert siglip.video_token_id not in (siglip.image_token_id, *siglip.frame_ids)
