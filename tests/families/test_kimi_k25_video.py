"""Kimi-K2.5 clips sampled, chunked, sized and prompted by batchvlm's rule (families.kimi_k25.VIDEO_RULE: the
checkpoint's own processor), against the rule's text where transformers samples otherwise, and against transformers'
Kimi_K25VideoProcessor / Kimi_K25Processor (grids, pixels, ids) and Kimi_K25Model (the clip's embeddings) on the
frames the rule samples."""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone

import numpy as np
import pytest
import torch
from transformers import Kimi_K25Processor, Kimi_K25VideoProcessor
from transformers.video_utils import VideoMetadata

from batchvlm.checks import CheckFailed
from batchvlm.config import ConfigError
from batchvlm.families.kimi_k25 import (VIDEO_TOKEN, KimiVideoParams, kimi_sample_frames, kimi_video_plan,
                                        timestamp_text, write_tiny_checkpoint)
from batchvlm.format.schema import FRAME, IMAGE, TEXT, VIDEO
from batchvlm.pipeline.preprocess import TorchPreprocessor
from batchvlm.pipeline.video import VideoConfig, decode_frames, probe
from clips import frame_pixels, make_clip
from photos import photo_of_size


# -- sampling and time: the rule's text (transformers samples otherwise) --------------------------------------------
@pytest.mark.parametrize("total, video_fps, sample_fps, expected", [
    (30, 10, 2.0, [0, 6, 12, 17, 23, 29]),  # 6 of 30: linspace(0, 29, 6) = 0, 5.8, 11.6, 17.4, 23.2, 29
    (31, 10, 2.0, [0, 6, 12, 18, 24, 30]),
    (5, 1, 2.0, [0, 1, 2, 3, 4]),  # the clip's own rate is below sample_fps: every frame
    (3, 30, 2.0, [0]),  # round(3 * 2 / 30) = 0 frames: at least one, linspace(0, 2, 1) = [0]
    (45, 30, 2.0, [0, 22, 44]),  # round(3.0) = 3
    (25, 10, 2.0, [0, 6, 12, 18, 24]),  # round(5.0) = 5
    (35, 10, 1.0, [0, 11, 23, 34]),  # round(3.5) = 4 (Python's round: half to even)
    (25, 10, 1.0, [0, 24]),  # round(2.5) = 2
])
def test_frames_are_sampled_at_the_smaller_rate_spread_by_linspace_as_the_checkpoint_processor_does(
        total, video_fps, sample_fps, expected):
    """split_video_chunks: sample_fps = min(sample_fps, fps); n = max(round(frames * sample_fps / fps), 1);
    indices = np.linspace(0, frames - 1, n).round()."""
    assert kimi_sample_frames(total, video_fps, KimiVideoParams(sample_fps=sample_fps)) == expected


def test_a_clip_without_frames_is_too_few_frames():
    with pytest.raises(CheckFailed, match="video.too_few_frames"):
        kimi_sample_frames(0, 24.0, KimiVideoParams())


def reference_timestamp(seconds: float) -> str:
    """media_utils.timestamp_as_str (hh:mm:ss.fff) and transformers' Kimi_K25Processor, as their text writes it."""
    theirs = datetime.fromtimestamp(seconds, tz=timezone.utc).strftime("%H:%M:%S") + f".{int((seconds % 1) * 1000):03d}"
    assert theirs == time.strftime("%H:%M:%S", time.gmtime(seconds)) + f".{int(seconds % 1 * 1000):03d}"
    return theirs


def test_chunk_times_are_written_as_the_reference_writes_them():
    rates = [1, 7.5, 10, 23.976, 24, 25, 29.97, 30, 60]
    for seconds in [index / rate for rate in rates for index in range(0, 4000, 37)] + [3599.9995, 59.9999, 0.001]:
        assert timestamp_text(seconds, "hh:mm:ss.fff") == reference_timestamp(seconds), seconds
    assert timestamp_text(75.25, "mm:ss.fff") == "01:15.250" and timestamp_text(75.25, "mm:ss") == "01:15"


def test_video_params_come_from_the_checkpoints_media_proc_cfg_and_bad_ones_are_refused(tmp_path):
    write_tiny_checkpoint(tmp_path)
    assert KimiVideoParams.from_checkpoint(tmp_path) == KimiVideoParams()  # the release's defaults
    config = json.loads((tmp_path / "preprocessor_config.json").read_text())
    config["media_proc_cfg"] |= {"sample_fps": 4.0, "temporal_merge_kernel_size": 2, "in_patch_limit_video": 100,
                                 "in_patch_limit_each_frame": None, "timestamp_mode": "mm:ss"}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    assert KimiVideoParams.from_checkpoint(tmp_path) == KimiVideoParams(4.0, 2, None, 100, "mm:ss")
    with pytest.raises(ConfigError, match="temporal_merge_kernel_size"):
        KimiVideoParams(temporal_merge_kernel_size=0)
    with pytest.raises(ConfigError, match="timestamp_mode"):
        KimiVideoParams(timestamp_mode="seconds")


# -- chunks: grids and pixels against transformers' video processor ------------------------------------------------
def hf_video_processor(family, max_patches: int, chunk: int = 4) -> Kimi_K25VideoProcessor:
    params = family.params
    return Kimi_K25VideoProcessor(
        patch_size=params.patch_size, merge_size=params.merge_size, temporal_patch_size=chunk,
        max_patches=max_patches, size={"max_height": params.max_patches_per_side,
                                       "max_width": params.max_patches_per_side},
        image_mean=list(params.image_mean), image_std=list(params.image_std), do_sample_frames=False)


def hf_processor(family) -> Kimi_K25Processor:
    """transformers' Kimi-K2.5 processor of the family's tokenizer, template, image and video processors."""
    return Kimi_K25Processor(image_processor=family.reference_processor(), tokenizer=family.tokenizer,
                             video_processor=hf_video_processor(family, family.video_params.in_patch_limit_each_frame),
                             chat_template=family.tokenizer.chat_template)


def chunk_rows(family, frames: np.ndarray, plan) -> list[torch.Tensor]:
    """Each chunk's frames through the torch backend as images at the chunk's plan, frame after frame."""
    preprocessor = TorchPreprocessor(family, torch.device("cpu"), "black")
    rows, start = [], 0
    for chunk in plan.chunks:
        count = len(chunk.frames)
        rows.append(torch.cat([preprocessor.rows_of(torch.from_numpy(frame), chunk.plan)[0]
                               for frame in frames[start:start + count]]))
        start += count
    return rows


def sampled_clip(frames: int, video_fps: int, height: int, width: int, video: KimiVideoParams):
    data = make_clip(frames, fps=video_fps, height=height, width=width)
    limits = VideoConfig()
    header = probe(data, limits)
    indices = kimi_sample_frames(header.frames, header.fps, video)
    return header, indices, decode_frames(data, header, indices, limits).frames


@pytest.mark.parametrize("frames, video_fps, height, width, video", [
    (31, 10, 64, 96, KimiVideoParams()),  # 6 frames: a chunk of 4, then one of 2
    (20, 5, 90, 160, KimiVideoParams(sample_fps=4.0)),  # 16 frames: 4 whole chunks
    (9, 10, 300, 200, KimiVideoParams(in_patch_limit_each_frame=64)),  # each frame shrunk to its budget
    (13, 5, 70, 120, KimiVideoParams(sample_fps=5.0, temporal_merge_kernel_size=3)),  # 13 frames: chunks 3,3,3,3,1
])
def test_chunk_grids_and_pixels_match_transformers_video_processor_on_the_sampled_frames(
        kimi_family, frames, video_fps, height, width, video):
    header, indices, decoded = sampled_clip(frames, video_fps, height, width, video)
    plan = kimi_video_plan(indices, header.fps, height, width, kimi_family.params, video)
    limit = video.in_patch_limit_each_frame or kimi_family.params.max_patches
    reference = hf_video_processor(kimi_family, limit, video.temporal_merge_kernel_size)(
        videos=[torch.from_numpy(decoded).permute(0, 3, 1, 2)], return_tensors="pt")
    assert reference["num_chunks_per_video"].tolist() == [len(plan.chunks)]
    assert reference["video_grid_thw"].tolist() == [list(grid) for grid in plan.grids]
    assert [len(chunk.frames) for chunk in plan.chunks][:-1] == [video.temporal_merge_kernel_size] * (
        len(plan.chunks) - 1)
    rows = torch.cat(chunk_rows(kimi_family, decoded, plan))
    assert rows.shape == reference["pixel_values_videos"].shape
    torch.testing.assert_close(rows, reference["pixel_values_videos"], atol=2 / 255 / 0.5 + 1e-6, rtol=0)


def test_in_patch_limit_video_is_shared_by_a_chunks_frames_so_a_short_last_chunk_gets_more(kimi_family):
    """navit_resize_video on a chunk (its frames at 1 fps, sample_fps inf): each frame's budget is
    min(round(in_patch_limit_video / frames in the chunk), in_patch_limit_each_frame). transformers has no such limit:
    the rule's text is the oracle."""
    video = KimiVideoParams(in_patch_limit_video=96)
    plan = kimi_video_plan(list(range(6)), 2.0, 280, 280, kimi_family.params, video)  # 20 x 20 patches a frame
    first, last = plan.chunks
    # 96 / 4 = 24 patches: scale sqrt(24 / 400) -> 68 px -> padded 84 -> 6 x 6; 96 / 2 = 48: 97 px -> 112 -> 8 x 8
    assert first.plan.grid_thw == (4, 6, 6) and last.plan.grid_thw == (2, 8, 8)
    assert (first.num_tokens, last.num_tokens) == (9, 16)


# -- the prompt: ids against transformers' Kimi_K25Processor ---------------------------------------------------------
def expanded_by_family(family, rendered: str, plans: list, image_plans: list) -> tuple[list[int], list[int]]:
    """The rendered conversation with each clip's placeholder replaced by the family's prompt for it (as the job's
    renderer places it), tokenized whole, each chunk's pad expanded to its tokens and each image's pad to its."""
    pieces = rendered.split(VIDEO_TOKEN)
    text = pieces[0] + "".join(family.video_prompt(plan) + piece for plan, piece in zip(plans, pieces[1:], strict=True))
    chunks = iter([chunk for plan in plans for chunk in plan.chunks])
    images, out, tags = iter(image_plans), [], []
    for token in family.tokenizer.encode(text, add_special_tokens=False):
        if token == family.video_token_id:
            count, tag = next(chunks).num_tokens, VIDEO
        elif token == family.image_token_id:
            count, tag = next(images).num_tokens, IMAGE
        else:
            count, tag = 1, FRAME if token in family.frame_token_ids else TEXT
        out += [token] * count
        tags += [tag] * count
    return out, tags


def test_a_clips_chunks_expand_to_the_ids_kimi_k25_processor_gives_its_chat_template(kimi_family):
    """A conversation with a clip (two chunks, the last of 2 frames) and an image, rendered by Kimi_K25Processor's
    apply_chat_template and run through it with the sampled frames and their metadata, gives the ids the family's
    expansion gives: per chunk `hh:mm:ss.fff` as text, `<|media_begin|>video<|media_content|>`, (h/2)(w/2) pads,
    `<|media_end|>`."""
    family, video_fps = kimi_family, 10
    frames = np.stack([frame_pixels(i, 64, 96) for i in range(31)])
    indices = family.video_sampler()(31, video_fps)
    plan = family.plan_video(indices, 31, video_fps, 64, 96)
    processor = hf_processor(family)
    image = photo_of_size(70, 120)
    messages = [{"role": "user", "content": [{"type": "text", "text": "Watch:"}, {"type": "video"},
                                             {"type": "text", "text": " then"}, {"type": "image"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "A ball rolls."}]}]
    rendered = processor.apply_chat_template(messages, tokenize=False)
    metadata = VideoMetadata(total_num_frames=31, fps=video_fps, height=64, width=96, frames_indices=indices)
    clip = torch.from_numpy(frames[indices]).permute(0, 3, 1, 2)
    reference = processor(text=[rendered], images=[image], videos=[clip], video_metadata=[metadata],
                          return_tensors="pt")
    ids, tags = expanded_by_family(family, rendered, [plan], [family.plan(*image.shape[:2])])
    assert ids == reference["input_ids"][0].tolist()
    # frame 24 at 10 fps: 2.4 % 1 * 1000 = 399.99..., truncated as the reference truncates it
    assert "00:00:02.399<|media_begin|>video<|media_content|>" in family.tokenizer.decode(ids)
    pads = [i for i, token in enumerate(ids) if token == family.video_token_id]
    assert len(pads) == plan.num_tokens == sum((h // 2) * (w // 2) for _, h, w in plan.grids)
    assert all(tags[i] == VIDEO for i in pads)
    first = pads[0]
    assert tags[first - 1] == FRAME and tags[pads[-1] + 1] == FRAME


# -- the tower: time embedding and temporal pooling, against the model's own video forward ---------------------------
def test_clips_are_taken_only_where_the_checkpoint_reads_them_at_the_clip_token_and_a_chunk_fits_its_time_table(
        kimi_family, tmp_path):
    import shutil

    from batchvlm.families import ModelConfig, load_family

    assert kimi_family.video_rule is not None and kimi_family.video_fingerprint()["params"]["sample_fps"] == 2.0
    shutil.copytree(kimi_family.checkpoint, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"video_token_id": kimi_family.video_token_id}))
    assert load_family(ModelConfig(path=str(tmp_path))).video_rule is not None
    (tmp_path / "config.json").write_text(json.dumps(config | {"video_token_id": 999}))
    assert load_family(ModelConfig(path=str(tmp_path))).video_rule is None
    config["vision_config"]["init_pos_emb_time"] = 2  # chunks of 4 frames would index past the time table
    (tmp_path / "config.json").write_text(json.dumps(config))
    family = load_family(ModelConfig(path=str(tmp_path)))
    assert family.video_rule is None and family.video_fingerprint() is None


# -- the job's text side: the renderer splices each chunk's prompt where the template put the clip ------------------
@pytest.mark.parametrize("format", ["llava", "messages"])
def test_a_record_with_a_clip_and_an_image_lays_out_as_kimi_k25_processor_gives_it_spans_and_tags_per_chunk(
        kimi_family, format):
    from batchvlm.pipeline.chat import TextConfig
    from batchvlm.pipeline.text import laid_out, text_side
    from batchvlm.records import ImageRef, SourceRecord
    from batchvlm.sources.conversations import read_turns

    family, video_fps = kimi_family, 10
    turns = {"llava": [{"from": "human", "value": "<video>\nWhat happens, and in <image>?"},
                       {"from": "gpt", "value": "A ball rolls."}],
             "messages": [{"role": "user", "content": [{"type": "video"},
                                                       {"type": "text", "text": "\nWhat happens, and in "},
                                                       {"type": "image"}, {"type": "text", "text": "?"}]},
                          {"role": "assistant", "content": "A ball rolls."}]}[format]
    record = SourceRecord(id="r", unit_id="u", source="s", row=0, text="", images=[ImageRef(data=b"i")],
                          videos=[ImageRef(path="/clips/a.mp4")], turns=read_turns(format, turns, "<image>", 1))
    side = text_side(family, format, "<image>", "prepend", TextConfig())
    indices = family.video_sampler()(31, video_fps)
    clip, image = family.plan_video(indices, 31, video_fps, 64, 96), family.plan(70, 120)
    layout = laid_out(side, side.placed(record), [image], TextConfig(), [clip])

    processor = hf_processor(family)
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "\nWhat happens, and in "},
                                             {"type": "image"}, {"type": "text", "text": "?"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "A ball rolls."}]}]
    frames = np.stack([frame_pixels(i, 64, 96) for i in indices])
    reference = processor(text=[processor.apply_chat_template(messages, tokenize=False)],
                          images=[photo_of_size(70, 120)], videos=[torch.from_numpy(frames).permute(0, 3, 1, 2)],
                          video_metadata=[VideoMetadata(total_num_frames=31, fps=video_fps, frames_indices=indices)],
                          return_tensors="pt")
    assert layout.input_ids == reference["input_ids"][0].tolist()
    assert [length for _, length in layout.video_spans] == [chunk.num_tokens for chunk in clip.chunks]
    tags, mask = np.asarray(layout.token_tags), np.asarray(layout.chat.loss_mask)
    for start, length in layout.video_spans:
        assert (tags[start:start + length] == VIDEO).all()
        assert tags[start - 1] == FRAME and tags[start + length] == FRAME
    first = layout.video_spans[0][0]
    clock, word = len(family.encode_text("00:00:00.000")), len(family.encode_text("video"))
    head = clock + 2 + word  # the time and "video" are text; <|media_begin|> and <|media_content|> frame them
    assert tags[first - head:first].tolist() == [TEXT] * clock + [FRAME] + [TEXT] * word + [FRAME]
    assert family.tokenizer.decode(layout.input_ids[first - head:first]) == \
        "00:00:00.000<|media_begin|>video<|media_content|>"
    assert not mask[:layout.video_spans[-1][0] + layout.video_spans[-1][1] + 1].any()  # the user turn: untrained
    assert mask.any() and (tags == VIDEO).sum() == clip.num_tokens


def test_after_a_space_the_ids_equal_the_processors_whose_bpe_fuses_the_space_with_the_clips_time(kimi_family):
    """Kimi_K25Processor replaces the clip token in the text and tokenizes the whole, so the text before a clip and the
    first chunk's time can share a token (here a byte-level BPE's " 0"); the job's renderer puts the clip's prompt into
    the rendering before tokenizing too, so its ids hold that token as well."""
    family = kimi_family
    indices = family.video_sampler()(31, 10)
    plan = family.plan_video(indices, 31, 10, 64, 96)
    processor = hf_processor(family)
    messages = [{"role": "user", "content": [{"type": "text", "text": "Watch "}, {"type": "video"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "A ball rolls."}]}]
    rendered = processor.apply_chat_template(messages, tokenize=False)
    frames = np.stack([frame_pixels(i, 64, 96) for i in indices])
    reference = processor(text=[rendered], videos=[torch.from_numpy(frames).permute(0, 3, 1, 2)], return_tensors="pt",
                          video_metadata=[VideoMetadata(total_num_frames=31, fps=10, frames_indices=indices)])
    theirs = reference["input_ids"][0].tolist()
    assert family.tokenizer.encode(" 0", add_special_tokens=False)[0] in theirs  # the fused token is there
    assert expanded_by_family(family, rendered, [plan], [])[0] == theirs


def test_the_jobs_clip_rows_are_each_chunks_frames_laid_out_as_images_even_where_chunks_differ_in_size(kimi_family):
    """preprocess.clip_rows (the job's path for a clip in parts) on a plan whose short last chunk has larger frames
    (in_patch_limit_video): each chunk's frames as the torch backend lays out images at the chunk's plan."""
    from batchvlm.pipeline.preprocess import clip_rows

    frames = np.stack([frame_pixels(i, 150, 200) for i in range(6)])
    plan = kimi_video_plan(list(range(6)), 2.0, 150, 200, kimi_family.params, KimiVideoParams(in_patch_limit_video=96))
    assert len({chunk.plan.padded for chunk in plan.chunks}) == 2
    ours = clip_rows(torch.from_numpy(frames), plan, kimi_family)
    assert torch.equal(ours, torch.cat(chunk_rows(kimi_family, frames, plan)))
    assert ours.shape[0] == plan.num_patches


def test_a_layout_cut_by_drop_turns_keeps_the_clips_whose_chunk_spans_it_holds(kimi_family):
    from batchvlm.records import clips_kept

    plans = [kimi_video_plan(list(range(n)), 2.0, 64, 96, kimi_family.params, KimiVideoParams()) for n in (6, 3, 9)]
    assert [len(plan.chunks) for plan in plans] == [2, 1, 3]
    assert [clips_kept(plans, spans) for spans in (0, 1, 2, 3, 5, 6)] == [0, 0, 1, 2, 2, 3]
