"""A plain text's clips (dataset.format=text with dataset.videos_column): one `<video>` per clip, each expanded by
the family where it stands, beside the images; counted, and refused by a family without a clip rule."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest

from batchvlm.checks import CheckFailed
from batchvlm.families import ModelConfig, load_family
from batchvlm.families.kimi_k25 import timestamp_text
from batchvlm.format.schema import FRAME, IMAGE, TEXT, VIDEO
from batchvlm.pipeline.chat import TextConfig
from batchvlm.pipeline.text import laid_out, text_side
from batchvlm.pipeline.tokens import attach_positions
from batchvlm.records import ImageRef, SourceRecord, clip_parts


@pytest.fixture(scope="module", params=["siglip2", "qwen2_vl", "kimi_k25"])
def family(request):
    return load_family(ModelConfig(family=request.param))


def record_of(text: str, videos: int, images: int = 0) -> SourceRecord:
    return SourceRecord(id="r", unit_id="u", source="s", row=0, text=text, images=[ImageRef(data=b"i")] * images,
                        videos=[ImageRef(path="/clips/a.mp4")] * videos)


def plain(family):
    return text_side(family, "text", "<image>", "prepend", TextConfig())


def test_each_clip_is_expanded_where_its_placeholder_stands_beside_the_images(family):
    side = plain(family)
    content = side.placed(record_of("first <video> then <image> and <video>.", videos=2, images=1))
    clips = [family.plan_video([0, 5, 10, 15, 18, 19], 20, 10.0, 64, 96), family.plan_video([0, 9], 12, 6.0, 90, 60)]
    image = family.plan(50, 80)
    layout = laid_out(side, content, [image], TextConfig(), clips)
    attach_positions(layout, [image], family, clips)
    ids, tags = np.array(layout.input_ids), np.array(layout.token_tags)
    # a span per clip, or per part of one (Kimi-K2.5's chunks)
    assert [length for _, length in layout.video_spans] == [part.num_tokens for part in clip_parts(clips)]
    (image_start, image_length), = layout.image_spans
    assert layout.video_spans[0][0] < image_start < layout.video_spans[-1][0]
    for start, length in layout.video_spans:
        assert set(ids[start:start + length]) == {family.video_token_id}
        assert set(tags[start:start + length]) == {VIDEO} and tags[start - 1] == tags[start + length] == FRAME
    assert set(tags[image_start:image_start + image_length]) == {IMAGE}
    # the text between them is the text's own tokens, and (Kimi-K2.5) each chunk's time and "video", text of its prompt
    text = family.tokenizer.decode(ids[tags == TEXT].tolist()).replace(" ", "")
    if family.name == "kimi_k25":
        times = [timestamp_text(chunk.start_s, family.video_params.timestamp_mode) for clip in clips
                 for chunk in clip.chunks]
        assert re.findall(r"\d\d:\d\d:\d\d\.\d\d\d", text) == times
        text = re.sub(r"\d\d:\d\d:\d\d\.\d\d\dvideo", "", text)
    assert text == "firstthenand."
    if family.name == "qwen2_vl":  # M-RoPE over the images and clips in sequence order
        assert layout.position_ids.shape == (3, len(ids))
    else:
        assert layout.position_ids is None


@pytest.mark.parametrize("text,videos", [("<video> and <video>", 1), ("a clip", 1), ("<video> with no clip", 0)])
def test_placeholders_and_clips_that_differ_in_count_are_named(family, text, videos):
    with pytest.raises(CheckFailed) as caught:
        plain(family).placed(record_of(text, videos))
    assert caught.value.check == "text.placeholder_count"
    assert f"Expected {videos} video placeholder" in caught.value.message


def test_a_family_without_a_clip_rule_refuses_a_plain_texts_clip_naming_itself(tmp_path):
    """A Qwen2-VL checkpoint whose config.json reads clips at another id than the tokenizer's `<|video_pad|>`."""
    qwen = load_family(ModelConfig(family="qwen2_vl"))
    shutil.copytree(qwen.checkpoint, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"video_token_id": qwen.image_token_id}))
    family = load_family(ModelConfig(family="qwen2_vl", path=str(tmp_path)))
    assert family.video_rule is None
    for text, videos in (("<video> a clip", 1), ("<video> no clip", 0)):
        with pytest.raises(CheckFailed) as caught:
            plain(family).placed(record_of(text, videos))
        assert caught.value.check == "text.video" and "model.family=qwen2_vl" in caught.value.message
    assert plain(family).placed(record_of("<image> a photo", 0, images=1)) == "<image> a photo"
