"""Qwen2/2.5-VL clips sampled and sized by batchvlm's rule, against transformers' own Qwen2VLVideoProcessor (the
rule's named reference, families.qwen2_vl.VIDEO_RULE) and Qwen2_5_VLProcessor's second_per_grid_ts."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from transformers import Qwen2VLVideoProcessor
from transformers.video_utils import VideoMetadata

from batchvlm.checks import CheckFailed
from batchvlm.config import ConfigError
from batchvlm.families import ModelConfig, load_family
from batchvlm.families.qwen2_vl import (QwenProcessorParams, QwenVideoParams, VideoPlan, mrope_positions,
                                       qwen_sample_frames, qwen_video_plan)
from batchvlm.format.layouts import MERGE_WINDOW, PatchLayout
from batchvlm.pipeline.preprocess import frame_rows
from batchvlm.pipeline.video import VideoConfig, decode_frames, probe
from clips import make_clip
from photos import preprocessed, photo_of_size

PARAMS = QwenProcessorParams()
LAYOUT = PatchLayout(MERGE_WINDOW, PARAMS.patch_size, PARAMS.merge_size, PARAMS.temporal_patch_size)


def hf_processor(video: QwenVideoParams, params: QwenProcessorParams = PARAMS, kind=Qwen2VLVideoProcessor):
    """The reference as VIDEO_RULE (kind=Qwen3VLVideoProcessor: QWEN3_VIDEO_RULE) names it, built from the same
    numbers (no hub)."""
    return kind(
        patch_size=params.patch_size, merge_size=params.merge_size, temporal_patch_size=params.temporal_patch_size,
        size={"shortest_edge": video.min_pixels, "longest_edge": video.max_pixels}, image_mean=list(params.image_mean),
        image_std=list(params.image_std), fps=video.fps, min_frames=video.min_frames, max_frames=video.max_frames,
        max_video_tokens=video.max_video_tokens, do_sample_frames=True, cap_pixels_per_frame=True)


def metadata(total: int, video_fps: float, height: int = 64, width: int = 96) -> VideoMetadata:
    return VideoMetadata(total_num_frames=total, fps=video_fps, height=height, width=width,
                         duration=total / video_fps)


@pytest.mark.parametrize("video", [QwenVideoParams(), QwenVideoParams(fps=1.0, min_frames=2, max_frames=16),
                                   QwenVideoParams(fps=4.5, min_frames=6, max_frames=40)])
def test_the_sampled_frames_are_the_video_processors_over_lengths_and_rates(video):
    processor = hf_processor(video)
    for total, video_fps in itertools.product([2, 3, 5, 7, 30, 31, 97, 301, 1999], [1, 7.5, 24, 29.97, 60]):
        ours = qwen_sample_frames(total, video_fps, PARAMS, video)
        theirs = processor.sample_frames(metadata(total, video_fps)).tolist()
        assert ours == theirs, (total, video_fps)
        assert len(ours) % 2 == 0 and len(ours) >= min(video.min_frames, total // 2 * 2)


def test_a_clip_shorter_than_one_temporal_patch_is_too_few_frames():
    with pytest.raises(CheckFailed, match="video.too_few_frames"):
        qwen_sample_frames(1, 24.0, PARAMS, QwenVideoParams())


def test_video_params_that_cannot_work_are_refused():
    with pytest.raises(ConfigError, match="min_frames"):
        QwenVideoParams(min_frames=10, max_frames=4)


@pytest.mark.parametrize("frames, video_fps, height, width, video", [
    (30, 10, 64, 96, QwenVideoParams()),  # the research notes' worked clip: frames 0, 5, 10.., grid [3, 20, 28]
    (31, 10, 64, 96, QwenVideoParams()),  # an odd frame count
    (45, 15, 90, 160, QwenVideoParams(fps=6.0)),
    (40, 25, 200, 120, QwenVideoParams(max_video_tokens=200)),  # the per-video budget caps each frame's pixels
    (24, 24, 48, 48, QwenVideoParams(min_pixels=28 * 28, max_pixels=56 * 56, min_frames=2)),  # shrunk to the cap
])
def test_grids_and_pixels_of_a_decoded_clip_match_the_video_processor(frames, video_fps, height, width, video):
    data = make_clip(frames, fps=video_fps, height=height, width=width)
    limits = VideoConfig()
    header = probe(data, limits)
    indices = qwen_sample_frames(header.frames, header.fps, PARAMS, video)
    clip = decode_frames(data, header, indices, limits)
    plan = qwen_video_plan(indices, header.frames, header.fps, *clip.frames.shape[1:3], PARAMS, video)

    everything = decode_frames(data, header, list(range(header.frames)), limits).frames
    reference = hf_processor(video)(videos=[torch.from_numpy(everything).permute(0, 3, 1, 2)],
                                    video_metadata=[metadata(frames, video_fps, height, width)], return_tensors="pt",
                                    return_metadata=True)
    assert list(plan.indices) == reference["video_metadata"][0].frames_indices.tolist()
    assert [list(plan.grid_thw)] == reference["video_grid_thw"].tolist()
    assert plan.num_tokens == reference["pixel_values_videos"].shape[0] // 4
    rows = frame_rows(torch.from_numpy(clip.frames), plan.resized, LAYOUT, PARAMS, "bicubic")
    assert rows.shape == reference["pixel_values_videos"].shape
    torch.testing.assert_close(rows, reference["pixel_values_videos"], atol=1e-5, rtol=0)


def test_the_per_video_budget_is_what_shrinks_a_densely_sampled_clip():
    """A frame's share of the per-video budget, not max_pixels, bounds it once enough frames are sampled."""
    few = qwen_video_plan(list(range(4)), 4, 2.0, 720, 1280, PARAMS, QwenVideoParams())
    many = qwen_video_plan(list(range(768)), 768, 2.0, 720, 1280, PARAMS, QwenVideoParams())
    assert few.resized[0] * few.resized[1] <= QwenVideoParams().max_pixels
    assert many.resized[0] * many.resized[1] < few.resized[0] * few.resized[1]
    assert many.num_tokens <= 0.9 * 128_000 + many.grid_thw[0] * 4  # within the budget, give or take the rounding


def sampled_clip_rows(family, frames: int, video_fps: int, height: int, width: int) -> tuple[torch.Tensor, tuple]:
    """A clip made, probed, sampled, decoded and laid out as the family's video rows, with its grid."""
    params, video, limits = family.params, QwenVideoParams(min_pixels=28 * 28, max_pixels=112 * 112), VideoConfig()
    data = make_clip(frames, fps=video_fps, height=height, width=width)
    header = probe(data, limits)
    indices = qwen_sample_frames(header.frames, header.fps, params, video)
    clip = decode_frames(data, header, indices, limits)
    plan = qwen_video_plan(indices, header.frames, header.fps, height, width, params, video)
    return frame_rows(torch.from_numpy(clip.frames), plan.resized, family.layout, params, family.resample), plan.grid_thw


@pytest.mark.parametrize("version", ["qwen2_vl", "qwen2_5_vl"])
def test_clips_packed_with_an_image_embed_as_the_models_own_video_forward_alone(tmp_path, version):
    """The tower as batchvlm loads it, on clips (t > 1: Qwen2.5-VL's windows span frames) packed with a still image,
    vs the full model's get_video_features on each clip alone (fp32)."""
    from test_qwen2_vl import _tiny_variant, qwen2_5_config
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration

    family = load_family(ModelConfig(family="qwen2_vl"))
    if version == "qwen2_5_vl":
        _tiny_variant(tmp_path, family, qwen2_5_config(family))
        family = load_family(ModelConfig(family="qwen2_vl", path=str(tmp_path)))
    model = {"qwen2_vl": Qwen2VLForConditionalGeneration, "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration}[
        version].from_pretrained(family.checkpoint).float().eval()
    clips = [sampled_clip_rows(family, 31, 10, 64, 96), sampled_clip_rows(family, 12, 4, 90, 50)]
    image_rows, image_grids = preprocessed(family, [photo_of_size(70, 120)])
    rows, grids = [clips[0][0], image_rows[0], clips[1][0]], [clips[0][1], image_grids[0], clips[1][1]]
    assert all(grid[0] > 1 for grid in (clips[0][1], clips[1][1]))
    packed = family.load_encoder(torch.device("cpu"), torch.float32)(torch.cat(rows), torch.tensor(grids))
    with torch.inference_mode():
        for index in (0, 2):
            alone = model.model.get_video_features(rows[index], torch.tensor([grids[index]])).pooler_output[0]
            ours = packed["image_embeds"][index]
            assert ours.shape == alone.shape
            assert (ours - alone).abs().max() <= 1e-4 * alone.abs().max() + 1e-6


def grid_plan(grid: tuple[int, int, int]) -> VideoPlan:
    return VideoPlan(indices=(), resized=(grid[1] * 14, grid[2] * 14), grid_thw=grid, num_tokens=math.prod(grid) // 4,
                     sampled_fps=1.0, second_per_grid_t=2.0)


def test_video_positions_follow_the_qwen2_5_vl_authors_worked_example():
    """transformers PR 35569 (Qwen2.5-VL, by its authors): 3 temporal patches of 2x2 merged tokens at 1 fps with 25
    tokens per second step 50 in time, and the text after starts at the largest position plus one (101).
    transformers 5.25's get_rope_index starts it at 2 (the spatial extent alone), below the clip's own times."""
    positions, delta = mrope_positions(17, [(0, 12)], [grid_plan((3, 4, 4))], merge_size=2, time_steps=[25 * 2 / 1])
    assert positions[0].tolist() == [0] * 4 + [50] * 4 + [100] * 4 + [101, 102, 103, 104, 105]
    assert positions[1].tolist() == [0, 0, 1, 1] * 3 + [101, 102, 103, 104, 105]
    assert positions[2].tolist() == [0, 1, 0, 1] * 3 + [101, 102, 103, 104, 105]
    assert delta == 106 - 17


def mixed_sequence(family, grids: list[tuple[int, int, int]], kinds: list[str]):
    """Text, then each span (an image or a clip) framed by vision start and end, text between and after: the ids,
    the token types get_rope_index takes (0 text, 1 image, 2 video) and each span's (start, length)."""
    convert = family.tokenizer.convert_tokens_to_ids
    pads = {"image": (family.image_token_id, 1), "video": (convert("<|video_pad|>"), 2)}
    start, end = convert("<|vision_start|>"), convert("<|vision_end|>")
    ids, types, spans = [11, 12], [0, 0], []
    for grid, kind in zip(grids, kinds):
        token, kind_type = pads[kind]
        count = math.prod(grid) // 4
        ids += [start]
        spans.append((len(ids), count))
        ids += [token] * count + [end, 13]
        types += [0] + [kind_type] * count + [0, 0]
    return torch.tensor([ids]), torch.tensor([types]), spans


@pytest.mark.parametrize("version", ["qwen2_vl", "qwen2_5_vl"])
def test_positions_of_clips_and_images_equal_get_rope_index_where_the_clip_is_shorter_than_it_is_wide(
        tmp_path, version):
    """Where a clip's last time is below its spatial extent, transformers 5.25 and the authors' rule agree."""
    from test_qwen2_vl import _tiny_variant, qwen2_5_config
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration

    family = load_family(ModelConfig(family="qwen2_vl"))
    if version == "qwen2_5_vl":
        _tiny_variant(tmp_path, family, qwen2_5_config(family))
        family = load_family(ModelConfig(family="qwen2_vl", path=str(tmp_path)))
    model = {"qwen2_vl": Qwen2VLForConditionalGeneration, "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration}[
        version].from_pretrained(family.checkpoint).eval()
    grids, kinds = [(3, 10, 12), (1, 6, 4), (2, 8, 10)], ["video", "image", "video"]
    seconds_per_grid = [0.5, 1.0]
    ids, types, spans = mixed_sequence(family, grids, kinds)
    videos = torch.tensor([g for g, k in zip(grids, kinds) if k == "video"])
    images = torch.tensor([g for g, k in zip(grids, kinds) if k == "image"])
    if version == "qwen2_5_vl":
        per_second = model.config.vision_config.tokens_per_second
        steps = [per_second * seconds_per_grid[0], 1.0, per_second * seconds_per_grid[1]]
        expected, expected_delta = model.model.get_rope_index(ids, types, image_grid_thw=images, video_grid_thw=videos,
                                                              second_per_grid_ts=torch.tensor(seconds_per_grid))
    else:
        steps = [1.0, 1.0, 1.0]
        expected, expected_delta = model.model.get_rope_index(ids, types, image_grid_thw=images,
                                                              video_grid_thw=videos)
    positions, delta = mrope_positions(ids.shape[1], spans, [grid_plan(g) for g in grids], 2, steps)
    assert positions.tolist() == expected[:, 0].tolist()
    assert delta == int(expected_delta)


# -- the family's clip prompt: ids, tags, time steps ----------------------------------------------------------------
def test_a_family_without_the_video_token_in_its_config_takes_no_clip(tmp_path):
    """A checkpoint whose config.json puts clips' embeddings at another id than the tokenizer's `<|video_pad|>` has
    no video rule (a clip laid out by it would feed the LLM text embeddings); its images are unaffected."""
    import json
    import shutil

    from batchvlm.families import tiny_checkpoint

    shutil.copytree(tiny_checkpoint("qwen2_vl"), tmp_path, dirs_exist_ok=True)
    assert load_family(ModelConfig(family="qwen2_vl", path=str(tmp_path))).video_rule is not None
    config = json.loads((tmp_path / "config.json").read_text())
    config["video_token_id"] += 1
    (tmp_path / "config.json").write_text(json.dumps(config))
    family = load_family(ModelConfig(family="qwen2_vl", path=str(tmp_path)))
    assert family.video_rule is None and family.video_token_id is None
    assert family.plan(56, 56).num_tokens == 4


@pytest.mark.parametrize("version", ["qwen2_vl", "qwen2_5_vl"])
def test_the_familys_time_steps_read_from_the_checkpoint_give_get_rope_indexs_positions(tmp_path, version):
    """The family's own positions of a clip, an image and a clip, with Qwen2.5-VL's tokens_per_second read from the
    checkpoint's config.json (2, as Qwen2.5-VL-7B releases it, not transformers' default 4), equal get_rope_index's
    with the clips' second_per_grid_ts (on clips shorter than they are wide, where it keeps the authors' rule)."""
    from test_qwen2_vl import _tiny_variant, qwen2_5_config
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration

    family = load_family(ModelConfig(family="qwen2_vl"))
    if version == "qwen2_5_vl":
        config = qwen2_5_config(family)
        config.vision_config.tokens_per_second = 2
        _tiny_variant(tmp_path, family, config)
        family = load_family(ModelConfig(family="qwen2_vl", path=str(tmp_path)))
        assert family.tokens_per_second == 2
    model = {"qwen2_vl": Qwen2VLForConditionalGeneration, "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration}[
        version].from_pretrained(family.checkpoint).eval()
    grids, kinds = [(3, 10, 12), (1, 6, 4), (2, 8, 10)], ["video", "image", "video"]
    ids, types, spans = mixed_sequence(family, grids, kinds)
    clips = [VideoPlan(indices=(), resized=(g[1] * 14, g[2] * 14), grid_thw=g, num_tokens=math.prod(g) // 4,
                       sampled_fps=2 * g[0] / seconds, second_per_grid_t=seconds)
             for g, seconds in ((grids[0], 1.0), (grids[2], 1.5))]
    plans = [clips[0], grid_plan(grids[1]), clips[1]]
    extra = {"second_per_grid_ts": torch.tensor([1.0, 1.5])} if version == "qwen2_5_vl" else {}
    expected, expected_delta = model.model.get_rope_index(
        ids, types, image_grid_thw=torch.tensor([grids[1]]), video_grid_thw=torch.tensor([grids[0], grids[2]]),
        **extra)
    positions, delta = family.media_positions(ids.shape[1], spans, plans)
    assert positions.tolist() == expected[:, 0].tolist()
    assert delta == int(expected_delta)
    if version == "qwen2_5_vl":  # the time steps did move: 2 per second x 1.5 s per patch
        assert family.time_step(clips[1]) == 3.0


def test_the_video_params_are_what_transformers_auto_video_processor_reads_from_the_checkpoint(tmp_path):
    """The tiny checkpoint ships no video processor config (as released Qwen2-VL): transformers takes the image
    processor's pixel sizes for frames, and so does the family; a checkpoint that ships one is read from it."""
    import shutil

    from transformers import AutoVideoProcessor

    from batchvlm.families import tiny_checkpoint

    def read_by_transformers(folder) -> QwenVideoParams:
        loaded = AutoVideoProcessor.from_pretrained(folder)
        return QwenVideoParams(fps=loaded.fps or QwenVideoParams.fps, min_frames=loaded.min_frames,
                               max_frames=loaded.max_frames, min_pixels=loaded.size.shortest_edge,
                               max_pixels=loaded.size.longest_edge, max_video_tokens=loaded.max_video_tokens)

    family = load_family(ModelConfig(family="qwen2_vl"))
    assert family.video_params == read_by_transformers(family.checkpoint)
    assert family.video_params.max_pixels == family.params.max_pixels != QwenVideoParams().max_pixels
    shutil.copytree(tiny_checkpoint("qwen2_vl"), tmp_path, dirs_exist_ok=True)
    hf_processor(QwenVideoParams(fps=1.0, min_frames=2, max_frames=64, min_pixels=28 * 28, max_pixels=56 * 56,
                                 max_video_tokens=1000)).save_pretrained(tmp_path)
    shipped = load_family(ModelConfig(family="qwen2_vl", path=str(tmp_path))).video_params
    assert shipped == read_by_transformers(tmp_path) == QwenVideoParams(1.0, 2, 64, 28 * 28, 56 * 56, 1000)


def test_a_clip_decoded_in_the_child_with_the_familys_sampler_plans_as_the_checkpoints_video_processor():
    """The family's sampler through the isolated decoder, then its plan, against AutoVideoProcessor as transformers
    loads it from the checkpoint (sampling with VIDEO_RULE's settings) on every frame of the clip."""
    from transformers import AutoVideoProcessor

    from batchvlm.pipeline.decode import DecodeConfig, Decoder
    from batchvlm.records import ImageRef

    family = load_family(ModelConfig(family="qwen2_vl"))
    data, frames, video_fps = make_clip(37, fps=12, height=90, width=140), 37, 12
    decoder = Decoder(DecodeConfig())
    try:
        clip = decoder.clip(ImageRef(data=data), 0, family.video_sampler())
    finally:
        decoder.close()
    plan = family.plan_video(list(clip.decoded.indices), clip.header.frames, clip.header.fps, 90, 140,
                             list(clip.decoded.timestamps_s))
    every = decode_frames(data, probe(data, VideoConfig()), list(range(frames)), VideoConfig()).frames
    reference = AutoVideoProcessor.from_pretrained(family.checkpoint)(
        videos=[torch.from_numpy(every).permute(0, 3, 1, 2)], do_sample_frames=True, cap_pixels_per_frame=True,
        fps=family.video_params.fps, video_metadata=[metadata(frames, video_fps, 90, 140)], return_tensors="pt")
    assert reference["video_grid_thw"].tolist() == [list(plan.grid_thw)]
    assert len(clip.decoded.indices) == 2 * plan.grid_thw[0]
