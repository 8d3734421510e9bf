"""Qwen3-VL clips against transformers' Qwen3VLVideoProcessor and Qwen3VLProcessor over the real vocabulary."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from batchvlm.families.qwen2_vl import QWEN3_VIDEO_RULE, Qwen3VideoParams
from batchvlm.pipeline.video import VideoConfig, decode_frames, probe
from clips import make_clip
from qwen_vocab import write_qwen3_checkpoint
from test_qwen2_vl_video import metadata
from test_qwen3_vl_video import SMALL, hf_processor

# the real vocabulary takes seconds to build
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, qwen_real_checkpoint):
    """The qwen2_vl family over the Qwen3-VL checkpoint with Qwen2's real vocabulary."""
    from batchvlm.families import ModelConfig, load_family

    folder = write_qwen3_checkpoint(tmp_path_factory.mktemp("qwen3_vl"), qwen_real_checkpoint, hf_processor(SMALL))
    return load_family(ModelConfig(family="qwen2_vl", path=str(folder)))


def test_qwen3s_video_params_and_rule_are_what_auto_video_processor_reads_from_the_checkpoint(qwen3):
    from transformers import AutoVideoProcessor

    loaded = AutoVideoProcessor.from_pretrained(qwen3.checkpoint)
    assert type(loaded).__name__ == "Qwen3VLVideoProcessor"
    assert qwen3.video_params == Qwen3VideoParams(
        fps=loaded.fps, min_frames=loaded.min_frames, max_frames=loaded.max_frames,
        min_pixels=loaded.size.shortest_edge, max_pixels=loaded.size.longest_edge,
        max_video_tokens=loaded.max_video_tokens) == SMALL
    assert list(loaded.image_mean) == list(qwen3.params.image_mean)  # frames normalized as the images are
    assert qwen3.video_rule == QWEN3_VIDEO_RULE and qwen3.video_fingerprint()["rule"] == QWEN3_VIDEO_RULE
    assert json.loads(json.dumps(qwen3.video_fingerprint()))["params"]["max_video_tokens"] == 64


def test_the_clip_parity_oracle_is_qwen3s_video_processor_and_holds_the_jobs_rows(qwen3):
    """family.reference_clip_rows (the job's clip parity sample) on a clip's sampled frames: the job's rows within
    float rounding, an odd count included (the last frame repeated)."""
    from batchvlm.pipeline.preprocess import clip_rows

    for frames, fps, height, width in [(31, 10, 64, 96), (12, 4, 90, 60)]:
        data = make_clip(frames, fps=fps, height=height, width=width)
        clip = decode_frames(data, probe(data, VideoConfig()), qwen3.video_sampler()(frames, fps),
                             VideoConfig()).frames
        plan = qwen3.plan_video(list(range(len(clip))), frames, fps, height, width)
        oracle = qwen3.reference_clip_rows(clip, plan)
        assert oracle.shape[0] == plan.num_patches
        torch.testing.assert_close(clip_rows(torch.from_numpy(clip), plan, qwen3), oracle, atol=1e-5, rtol=0)


# -- the prompt: ids, tags, mask and positions of a conversation with clips and an image ---------------------------
CLIPS = {"a.mp4": (31, 10, 64, 96), "b.mp4": (12, 4, 90, 60)}
"""name -> (frames, fps, height, width)."""

CONVERSATION = [{"from": "human", "value": "<video>\nWhat happens, and in <image>? Then <video>"},
                {"from": "gpt", "value": "A ball rolls: <0.5 seconds> in."}]
"""Each clip after a different character (a newline, a space), as the processor's tokenization of its first
timestamp depends on it; the answer writes a timestamp of its own, text the record trains."""


def decoded(name: str, family) -> tuple:
    """A clip made, probed, sampled with the family's sampler, decoded, planned with its pts times; and all its
    frames (the processor's input)."""
    frames, video_fps, height, width = CLIPS[name]
    data = make_clip(frames, fps=video_fps, height=height, width=width)
    limits = VideoConfig()
    header = probe(data, limits)
    indices = family.video_sampler()(header.frames, header.fps)
    clip = decode_frames(data, header, indices, limits)
    plan = family.plan_video(indices, header.frames, header.fps, height, width, list(clip.timestamps_s))
    every = decode_frames(data, header, list(range(header.frames)), limits).frames
    return plan, clip, torch.from_numpy(every).permute(0, 3, 1, 2)


def qwen3_processor(family):
    from transformers import AutoImageProcessor, AutoVideoProcessor, Qwen3VLProcessor

    return Qwen3VLProcessor(image_processor=AutoImageProcessor.from_pretrained(family.checkpoint),
                            video_processor=AutoVideoProcessor.from_pretrained(family.checkpoint),
                            tokenizer=family.tokenizer, chat_template=family.tokenizer.chat_template)


def reference_of(family, videos: list[str], image: np.ndarray, turns: list[dict] = CONVERSATION):
    """Qwen3VLProcessor's apply_chat_template over the turns as messages, then its expansion with every frame of each
    clip (sampled by its video processor, given their metadata) and the image."""
    processor = qwen3_processor(family)
    messages = []
    for turn in turns:
        blocks, text = [], turn["value"]
        if turn["from"] == "human":
            for piece in text.replace("<video>", "\0video\0").replace("<image>", "\0image\0").split("\0"):
                blocks.append({"type": piece} if piece in ("video", "image") else {"type": "text", "text": piece})
            blocks = [b for b in blocks if b.get("text", True)]
        else:
            blocks = [{"type": "text", "text": text}]
        messages.append({"role": {"human": "user", "gpt": "assistant"}[turn["from"]], "content": blocks})
    rendered = processor.apply_chat_template(messages, tokenize=False)
    clips = [decoded(name, family)[2] for name in videos]
    metadata_of = [metadata(CLIPS[n][0], CLIPS[n][1], CLIPS[n][2], CLIPS[n][3]) for n in videos]
    return processor(text=[rendered], images=[image], videos=clips, return_tensors="pt",
                     videos_kwargs={"video_metadata": metadata_of, "do_sample_frames": True,
                                    "cap_pixels_per_frame": True})


def test_a_conversation_with_clips_lays_out_as_qwen3vl_processor_gives_it(qwen3):
    """The job's renderer over Qwen2's real vocabulary and Qwen3-VL's template: the ids are the processor's (each
    clip's timestamps tokenized with the text before them, as text); one span per temporal patch of (h/2)(w/2) video
    tokens between start and end; the timestamps tagged text and never trained, even under train_on=all; the M-RoPE
    positions are the model's own get_rope_index's."""
    from transformers import Qwen3VLForConditionalGeneration

    from batchvlm.format.schema import FRAME, TEXT, VIDEO
    from batchvlm.pipeline.chat import TextConfig
    from batchvlm.pipeline.text import laid_out, text_side
    from batchvlm.pipeline.tokens import attach_positions
    from batchvlm.records import ImageRef, SourceRecord
    from batchvlm.sources.conversations import read_turns
    from batchvlm.training.interop import mm_token_type_ids
    from photos import photo_of_size

    image, videos = photo_of_size(70, 120), ["a.mp4", "b.mp4"]
    plans = [decoded(name, qwen3)[0] for name in videos]
    reference = reference_of(qwen3, videos, image)
    assert [list(p.grid_thw) for p in plans] == reference["video_grid_thw"].tolist()
    model = Qwen3VLForConditionalGeneration.from_pretrained(qwen3.checkpoint).eval()
    for train_on in ("assistant", "all"):
        config = TextConfig(train_on=train_on)
        side = text_side(qwen3, "llava", "<image>", "prepend", config)
        record = SourceRecord(id="r", unit_id="u", source="s", row=0, text="", images=[ImageRef(data=b"i")],
                              videos=[ImageRef(path=name) for name in videos],
                              turns=read_turns("llava", CONVERSATION, "<image>", 1))
        image_plan = qwen3.plan(*image.shape[:2])
        layout = laid_out(side, side.placed(record), [image_plan], config, plans)
        attach_positions(layout, [image_plan], qwen3, plans)
        assert layout.input_ids == reference["input_ids"][0].tolist()
        tags, mask = np.asarray(layout.token_tags), np.asarray(layout.chat.loss_mask)
        spans = [span for plan in plans for span in plan.spans]
        assert len(layout.video_spans) == len(spans) == sum(p.grid_thw[0] for p in plans)
        for (start, length), span in zip(layout.video_spans, spans):
            assert length == span.num_tokens
            assert tags[start - 1:start + length + 1].tolist() == [FRAME] + [VIDEO] * length + [FRAME]
        stamp = qwen3.tokenizer.encode("<0.3 seconds>", add_special_tokens=False)
        first = layout.video_spans[0][0] - 1 - len(stamp)
        assert layout.input_ids[first:first + len(stamp)] == stamp and set(tags[first:first + len(stamp)]) == {TEXT}
        assert not mask[tags == VIDEO].any() and not mask[first:first + len(stamp)].any() and mask.any()
        types = mm_token_type_ids(torch.tensor([layout.token_tags], dtype=torch.int8))
        assert types.tolist() == reference["mm_token_type_ids"].tolist()
        positions, delta = model.model.get_rope_index(reference["input_ids"], types,
                                                      image_grid_thw=reference["image_grid_thw"],
                                                      video_grid_thw=reference["video_grid_thw"])
        assert layout.position_ids.tolist() == positions[:, 0].tolist() and layout.rope_delta == int(delta)


def test_a_plain_texts_clip_lays_out_a_timestamp_and_a_span_per_temporal_patch_with_positions(qwen3):
    """A captioned clip (dataset.format=text with dataset.videos_column) has no template to place its prompt in: the
    prompt is tokenized where its `<video>` stands, a span per temporal patch, each after its timestamp as text."""
    from batchvlm.format.schema import FRAME, TEXT
    from batchvlm.pipeline.chat import TextConfig
    from batchvlm.pipeline.text import laid_out, text_side
    from batchvlm.pipeline.tokens import attach_positions
    from batchvlm.records import ImageRef, SourceRecord

    side = text_side(qwen3, "text", "<image>", "prepend", TextConfig())
    record = SourceRecord(id="r", unit_id="u", source="s", row=0, text="A clip: <video> the end.", images=[],
                          videos=[ImageRef(path="/clips/a.mp4")])
    plan = qwen3.plan_video([0, 6, 12, 17, 23, 29], 30, 10.0, 64, 96)
    layout = laid_out(side, side.placed(record), [], TextConfig(), [plan])
    attach_positions(layout, [], qwen3, [plan])
    tags = np.asarray(layout.token_tags)
    assert [length for _, length in layout.video_spans] == [span.num_tokens for span in plan.spans]
    assert len(layout.video_spans) == plan.grid_thw[0] == 3
    for (start, length), seconds in zip(layout.video_spans, plan.timestamps):
        stamp = qwen3.tokenizer.encode(f"<{seconds:.1f} seconds>", add_special_tokens=False)
        assert layout.input_ids[start - 1 - len(stamp):start - 1] == stamp
        assert set(tags[start - 1 - len(stamp):start - 1]) == {TEXT} and tags[start - 1] == FRAME
    assert layout.position_ids.shape == (3, len(layout.input_ids))
