"""Qwen2/2.5-VL clips against transformers' processors over the real vocabulary: second_per_grid_ts and a clip's ids."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batchvlm.families.qwen2_vl import QwenVideoParams, VideoPlan, qwen_sample_frames, qwen_video_plan
from clips import frame_pixels
from photos import photo_of_size
from test_qwen2_vl_video import PARAMS, hf_processor, metadata

# the real vocabulary takes seconds to build
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def qwen25_processor(tmp_path_factory):
    """Qwen2_5_VLProcessor over Qwen2's real vocabulary (built offline) and the reference video processor."""
    from transformers import AutoTokenizer, Qwen2_5_VLProcessor, Qwen2VLImageProcessor

    from qwen_vocab import write_tokenizer

    folder = tmp_path_factory.mktemp("qwen25_tokenizer")
    write_tokenizer(folder)
    return Qwen2_5_VLProcessor(image_processor=Qwen2VLImageProcessor(), video_processor=hf_processor(QwenVideoParams()),
                               tokenizer=AutoTokenizer.from_pretrained(folder))


@pytest.mark.parametrize("frames, video_fps", [
    (30, 10),  # fps sampling as configured: 2 frames/s, 1 s per temporal patch
    (7, 24),  # clamped up to min_frames: 4 of 7 frames, 13.7 frames/s, not the configured 2
    (60, 1),  # fps 2 on a 1 fps clip is clamped down to its 60 frames: 1 frame/s, 2 s per temporal patch
])
def test_second_per_grid_ts_comes_from_the_sampled_rate_as_qwen2_5_vls_processor_computes_it(
        qwen25_processor, frames, video_fps):
    video = QwenVideoParams()
    indices = qwen_sample_frames(frames, video_fps, PARAMS, video)
    plan = qwen_video_plan(indices, frames, video_fps, 56, 56, PARAMS, video)
    clip = torch.from_numpy(np.stack([frame_pixels(i % 50, 56, 56) for i in range(frames)])).permute(0, 3, 1, 2)
    reference = qwen25_processor(text=["<|vision_start|><|video_pad|><|vision_end|>"], videos=[clip],
                                 videos_kwargs={"video_metadata": [metadata(frames, video_fps, 56, 56)]},
                                 return_tensors="pt")
    assert reference["second_per_grid_ts"].tolist() == pytest.approx([plan.second_per_grid_t])
    assert plan.second_per_grid_t == pytest.approx(2 / (len(indices) / frames * video_fps))
    video_pad = qwen25_processor.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    assert int((reference["input_ids"] == video_pad).sum()) == plan.num_tokens


# -- the family's clip prompt: ids, tags, time steps ----------------------------------------------------------------
def expanded_by_family(family, rendered: str, plans: list[VideoPlan], image_plans: list) -> tuple[list[int], list]:
    """The rendered conversation tokenized, each `<|video_pad|>` and `<|image_pad|>` (with its frame tokens) replaced
    by what the family expands it to; the tags and each span's (start, length) in sequence order."""
    ids = family.tokenizer.encode(rendered, add_special_tokens=False)
    clips, images, out, tags, spans = iter(plans), iter(image_plans), [], [], []
    for index, token in enumerate(ids):
        if token in family.frame_ids and (index + 1 < len(ids) and ids[index + 1] in (
                family.video_token_id, family.image_token_id) or ids[index - 1] in (
                family.video_token_id, family.image_token_id)):
            continue  # the expansion brings its own frame tokens
        if token in (family.video_token_id, family.image_token_id):
            plan = next(clips) if token == family.video_token_id else next(images)
            span_ids, span_tags = (family.expand_video if token == family.video_token_id else family.expand_image)(plan)
            spans.append((len(out) + 1, plan.num_tokens))
            out += span_ids
            tags += span_tags
        else:
            out.append(token)
            tags.append(0)
    return out, tags, spans


def test_a_clip_expands_to_the_ids_qwen2_vls_processor_gives_its_chat_template(qwen_real):
    """Qwen2-VL over its real vocabulary: a conversation with a clip and an image, rendered by the processor's
    apply_chat_template and run through the processor with the clip's frames, gives the ids the family's expansion
    gives; the clip's tokens are tagged VIDEO between two FRAME tokens."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor

    from batchvlm.format.schema import FRAME, VIDEO

    family, video = qwen_real, QwenVideoParams(min_pixels=28 * 28, max_pixels=112 * 112)
    assert family.video_rule is not None and family.video_token_id == 151656  # Qwen2-VL's published id
    processor = Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(**{
        "size": {"shortest_edge": family.params.min_pixels, "longest_edge": family.params.max_pixels}}),
        video_processor=hf_processor(video, family.params), tokenizer=family.tokenizer,
        chat_template=family.tokenizer.chat_template)
    frames, video_fps = 31, 10
    clip = np.stack([frame_pixels(i % 50, 64, 96) for i in range(frames)])
    image = photo_of_size(70, 120)
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens, and in"},
                                             {"type": "image"}, {"type": "text", "text": "?"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "A ball rolls."}]}]
    rendered = processor.apply_chat_template(messages, tokenize=False)
    reference = processor(text=[rendered], images=[image], videos=[torch.from_numpy(clip).permute(0, 3, 1, 2)],
                          videos_kwargs={"video_metadata": [metadata(frames, video_fps, 64, 96)]},
                          return_tensors="pt")
    indices = qwen_sample_frames(frames, video_fps, family.params, video)
    plan = qwen_video_plan(indices, frames, video_fps, 64, 96, family.params, video)
    assert reference["video_grid_thw"].tolist() == [list(plan.grid_thw)]
    ids, tags, spans = expanded_by_family(family, rendered, [plan], [family.plan(*image.shape[:2])])
    assert ids == reference["input_ids"][0].tolist()
    start, length = spans[0]
    assert tags[start - 1:start + length + 1] == [FRAME] + [VIDEO] * length + [FRAME]
