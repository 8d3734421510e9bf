"""A SigLIP2 clip packed with an image encodes as the model's forward on each frame."""

from __future__ import annotations

import pytest
import torch
from hf_models import pretrained
from transformers import Siglip2Model

from clips import make_clip
from photos import photo_of_size, preprocessed

from batchvlm.pipeline.preprocess import frame_rows
from batchvlm.pipeline.video import VideoConfig, decode_clip
import test_siglip2_video

# the HF model run frame by frame
pytestmark = pytest.mark.slow
siglip = test_siglip2_video.siglip  # test_siglip2_video.py's fixture (built again here, in under a second)


def test_a_clip_packed_with_an_image_encodes_as_the_models_forward_on_each_frame(siglip):
    """Patch tokens and pooled vectors of a clip (its frames' joined, one pooled vector per frame) packed between two
    images == Siglip2Model's vision forward (from_pretrained) on each frame alone, padded to the budget as the
    processor pads it; the images' as before."""
    reference = pretrained(siglip.checkpoint, Siglip2Model, dtype=torch.float32).vision_model
    encoder = siglip.load_encoder(torch.device("cpu"), torch.float32)
    clip = decode_clip(make_clip(30, fps=10, height=72, width=128), VideoConfig(), siglip.video_sampler())
    frames = clip.decoded.frames
    plan = siglip.plan_video(list(clip.decoded.indices), clip.header.frames, clip.header.fps, *frames.shape[1:3])
    clip_rows = frame_rows(torch.from_numpy(frames), plan.resized, siglip.layout, siglip, siglip.resample)
    image_rows, image_grids = preprocessed(siglip, [photo_of_size(50, 90), photo_of_size(200, 30)])
    grids = torch.tensor([image_grids[0], plan.grid_thw, image_grids[1]])
    out = encoder(torch.cat([image_rows[0], clip_rows, image_rows[1]]), grids)
    t, h, w = plan.grid_thw
    assert t == 6 and out["image_embeds"][1].shape == (t * h * w, encoder.hidden_size)
    assert out["pooled_embeds"][1].shape == (t, encoder.hidden_size)
    per_frame = clip_rows.reshape(t, h * w, -1)
    alone = [_alone(reference, rows, h, w, siglip.video_params.max_num_patches) for rows in per_frame]
    assert torch.allclose(out["image_embeds"][1], torch.cat([tokens for tokens, _ in alone]), rtol=1e-4, atol=1e-5)
    assert torch.allclose(out["pooled_embeds"][1], torch.cat([pooled for _, pooled in alone]), rtol=1e-4, atol=1e-5)
    for index, (rows, (_, gh, gw)) in zip((0, 2), zip(image_rows, image_grids)):
        tokens, pooled = _alone(reference, rows, gh, gw, siglip.params.max_num_patches)
        assert torch.allclose(out["image_embeds"][index], tokens, rtol=1e-4, atol=1e-5)
        assert torch.allclose(out["pooled_embeds"][index], pooled, rtol=1e-4, atol=1e-5)


def _alone(reference, rows: torch.Tensor, h: int, w: int, budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's own forward on one image's rows, padded to `budget` with its attention mask."""
    padded = torch.zeros(1, budget, rows.shape[1])
    padded[0, :h * w] = rows
    mask = (torch.arange(budget) < h * w)[None].long()
    with torch.inference_mode():
        out = reference(pixel_values=padded, pixel_attention_mask=mask, spatial_shapes=torch.tensor([[h, w]]))
    return out.last_hidden_state[0, :h * w], out.pooler_output
