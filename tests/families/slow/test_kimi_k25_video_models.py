"""Kimi-K2.5 clips against the model's own video forward, and over a real BPE the processor's ids."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.video_utils import VideoMetadata

from batchvlm.families.kimi_k25 import kimi_video_plan
from clips import frame_pixels
from photos import photo_of_size, preprocessed
from test_kimi_k25_video import chunk_rows, expanded_by_family, hf_processor, hf_video_processor, sampled_clip

# the full model, and the real vocabulary
pytestmark = pytest.mark.slow


# -- the tower: time embedding and temporal pooling, against the model's own video forward ---------------------------
def test_chunks_packed_with_an_image_embed_as_the_models_own_video_forward_on_the_processors_pixels(kimi_family):
    """Two clips' chunks (4 frames and a last one of 2 and of 1: the time embedding, none for t = 1, and the mean
    over t) packed with a still image through the tower as batchvlm loads it, vs Kimi_K25Model.get_video_features
    (from_pretrained) on transformers' video processor's pixels of each clip alone (fp32)."""
    from transformers import Kimi_K25ForConditionalGeneration

    from hf_models import pretrained

    family = kimi_family
    model = pretrained(family.checkpoint, Kimi_K25ForConditionalGeneration, dtype=torch.float32)
    video = family.video_params
    clips = [sampled_clip(31, 10, 64, 96, video), sampled_clip(25, 10, 90, 50, video)]  # 6 and 5 frames
    plans = [kimi_video_plan(indices, header.fps, *decoded.shape[1:3], family.params, video)
             for header, indices, decoded in clips]
    assert [[grid[0] for grid in plan.grids] for plan in plans] == [[4, 2], [4, 1]]
    image_rows, image_grids = preprocessed(family, [photo_of_size(70, 120)])
    clip_rows = [chunk_rows(family, decoded, plan) for (_, _, decoded), plan in zip(clips, plans)]
    rows = [*clip_rows[0], image_rows[0], *clip_rows[1]]
    grids = [*plans[0].grids, image_grids[0], *plans[1].grids]
    packed = family.load_encoder(torch.device("cpu"), torch.float32)(torch.cat(rows), torch.tensor(grids))
    ours = packed["image_embeds"]
    with torch.inference_mode():
        for (_, _, decoded), plan, first in zip(clips, plans, (0, 3)):
            reference = hf_video_processor(family, video.in_patch_limit_each_frame)(
                videos=[torch.from_numpy(decoded).permute(0, 3, 1, 2)], return_tensors="pt")
            alone = model.model.get_video_features(reference["pixel_values_videos"],
                                                   reference["video_grid_thw"]).pooler_output
            assert len(alone) == len(plan.chunks)
            for chunk, expected, got in zip(plan.chunks, alone, ours[first:first + len(plan.chunks)]):
                assert got.shape == expected.shape == (chunk.num_tokens, model.config.text_config.hidden_size)
                assert (got - expected).abs().max() <= 1e-3 * expected.abs().max() + 1e-5
        # the time embedding and the pooling matter: the chunk's frames alone, as images, give other tokens
        frame_by_frame = model.model.get_image_features(clip_rows[0][0], torch.tensor(
            [(1, *plans[0].grids[0][1:])] * 4)).pooler_output
        assert (torch.stack(frame_by_frame).mean(0) - ours[0]).abs().max() > 1e-3 * ours[0].abs().max()


def test_over_a_real_bpe_that_splits_digits_the_ids_equal_the_processors_after_a_space_and_a_digit_too(
        tmp_path, qwen_real_checkpoint):
    """The tiny Kimi-K2.5 checkpoint over Qwen2's real BPE, whose pre-tokenizer keeps every digit a token of its own and
    apart from a space: the reference's whole-text tokenization and batchvlm's time-apart one give the same ids,
    whatever text stands before a clip."""
    import qwen_vocab

    from batchvlm.families import ModelConfig, load_family, tiny_checkpoint

    qwen_vocab.write_kimi_checkpoint(tmp_path, qwen_real_checkpoint, tiny_checkpoint("kimi_k25"))
    family = load_family(ModelConfig(family="kimi_k25", path=str(tmp_path)))
    assert family.video_rule is not None
    indices = family.video_sampler()(31, 10)
    plan = family.plan_video(indices, 31, 10, 64, 96)
    processor = hf_processor(family)
    frames = torch.from_numpy(np.stack([frame_pixels(i, 64, 96) for i in indices])).permute(0, 3, 1, 2)
    for before in ("Watch ", "clip 2", "Look:", ""):
        messages = [{"role": "user", "content": [{"type": "text", "text": before}, {"type": "video"}]},
                    {"role": "assistant", "content": [{"type": "text", "text": "A ball rolls."}]}]
        rendered = processor.apply_chat_template(messages, tokenize=False)
        reference = processor(text=[rendered], videos=[frames], return_tensors="pt",
                              video_metadata=[VideoMetadata(total_num_frames=31, fps=10, frames_indices=indices)])
        assert expanded_by_family(family, rendered, [plan], [])[0] == reference["input_ids"][0].tolist(), before
