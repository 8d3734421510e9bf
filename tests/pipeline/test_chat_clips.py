"""A conversation's clips on the text side: placed, rendered with the checkpoint's template, expanded to their plans'
spans and positioned with the images in sequence order; refused (text.video) by a family without a clip rule."""

from __future__ import annotations

import math

import numpy as np
import pytest

from batchvlm.checks import CheckFailed
from batchvlm.families import ModelConfig, load_family
from batchvlm.families.qwen2_vl import VideoPlan
from batchvlm.format.schema import FRAME, IMAGE, VIDEO
from batchvlm.pipeline.chat import TextConfig
from batchvlm.pipeline.text import laid_out, text_side
from batchvlm.pipeline.tokens import attach_positions
from batchvlm.records import ImageRef, SourceRecord
from batchvlm.sources.conversations import read_turns

LLAVA = [{"from": "human", "value": "<video>\nWhat happens, and in <image>?"},
         {"from": "gpt", "value": "A ball rolls."}]
MESSAGES = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "\nWhat happens, and in "},
                                         {"type": "image"}, {"type": "text", "text": "?"}]},
            {"role": "assistant", "content": "A ball rolls."}]


@pytest.fixture(scope="module")
def qwen():
    return load_family(ModelConfig(family="qwen2_vl"))


def record_of(format: str, turns, videos: int = 1, images: int = 1) -> SourceRecord:
    return SourceRecord(id="r", unit_id="u", source="s", row=0, text="", images=[ImageRef(data=b"i")] * images,
                        videos=[ImageRef(path="/clips/a.mp4")] * videos,
                        turns=read_turns(format, turns, "<image>", images))


def clip_plan(grid: tuple[int, int, int]) -> VideoPlan:
    return VideoPlan(indices=tuple(range(2 * grid[0])), resized=(grid[1] * 14, grid[2] * 14), grid_thw=grid,
                     num_tokens=math.prod(grid) // 4, sampled_fps=2.0, second_per_grid_t=1.0)


@pytest.mark.parametrize("format,turns", [("llava", LLAVA), ("messages", MESSAGES)])
def test_a_clip_lays_out_as_its_span_of_video_tokens_before_the_image_never_trained(qwen, format, turns):
    side = text_side(qwen, format, "<image>", "prepend", TextConfig())
    record = record_of(format, turns)
    image, clip = qwen.plan(56, 84), clip_plan((3, 8, 12))
    layout = laid_out(side, side.placed(record), [image], TextConfig(), [clip])
    attach_positions(layout, [image], qwen, [clip])
    (clip_start, clip_length), = layout.video_spans
    (image_start, _), = layout.image_spans
    assert clip_length == clip.num_tokens == 72 and clip_start < image_start
    tags, mask = np.asarray(layout.token_tags), np.asarray(layout.chat.loss_mask)
    assert tags[clip_start - 1:clip_start + clip_length + 1].tolist() == [FRAME] + [VIDEO] * 72 + [FRAME]
    assert (tags == IMAGE).sum() == image.num_tokens and not mask[tags == VIDEO].any() and mask.any()
    # M-RoPE: the clip's three temporal patches at times 0, 1, 2 from where it starts; the image after it
    times = layout.position_ids[0, clip_start:clip_start + clip_length]
    assert sorted(set((times - times.min()).tolist())) == [0, 1, 2]
    assert layout.position_ids[0, image_start] > times.max()


def test_llava_and_messages_records_of_the_same_conversation_lay_out_alike(qwen):
    layouts = []
    for format, turns in (("llava", LLAVA), ("messages", MESSAGES)):
        side = text_side(qwen, format, "<image>", "prepend", TextConfig())
        layouts.append(laid_out(side, side.placed(record_of(format, turns)), [qwen.plan(56, 84)], TextConfig(),
                                [clip_plan((2, 4, 4))]))
    assert layouts[0].input_ids == layouts[1].input_ids and layouts[0].video_spans == layouts[1].video_spans


def test_a_family_without_a_clip_rule_quarantines_a_clip_as_text_video_saying_so(kimi_family, tmp_path):
    import json
    import shutil

    shutil.copytree(kimi_family.checkpoint, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"video_token_id": 999}))  # clips read elsewhere
    family = load_family(ModelConfig(path=str(tmp_path)))
    assert family.video_rule is None
    side = text_side(family, "llava", "<image>", "prepend", TextConfig())
    with pytest.raises(CheckFailed) as caught:
        side.placed(record_of("llava", LLAVA))
    assert caught.value.check == "text.video" and "has no video rule" in caught.value.message
    assert "model.family=kimi_k25" in caught.value.message
    side.placed(record_of("llava", [{"from": "human", "value": "<image> What?"}, {"from": "gpt", "value": "A."}],
                          videos=0))  # its images alone pass


def test_a_clip_named_twice_but_placed_once_is_the_placeholder_count(qwen):
    side = text_side(qwen, "llava", "<image>", "prepend", TextConfig())
    with pytest.raises(CheckFailed) as caught:
        side.placed(record_of("llava", LLAVA, videos=2))
    assert caught.value.check == "text.placeholder_count" and caught.value.expected == "2"
