"""Clips under preprocess.backend=triton: the frames of a clip laid out as images (Kimi-K2.5's chunk frames, SigLIP2's
NaFlex frames) go through the batch's one kernel launch with its images, their rows held to the torch path
(`clip_rows`) and to the family's HF processor on the same frames; Qwen's temporal pairs too, each time slice of a
row from its own frame.

Interpreted without a GPU (TRITON_INTERPRET=1, set before anything imports kernels/pack_pixels.py), so the frames are
tiny; `jobs/gpu_check.sh` runs this file compiled on a GPU.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from batchvlm.format.layouts import MERGE_WINDOW, PatchLayout  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_a_second_time_slice_of_another_size_is_refused():
    from batchvlm.kernels.pack_pixels import pack_images

    frames = [torch.zeros((28, 28, 3), dtype=torch.uint8), torch.zeros((28, 56, 3), dtype=torch.uint8)]
    with pytest.raises(ValueError, match="second time slice"):
        pack_images(frames, [(28, 28), (28, 56)], [(28, 28), (28, 56)], PatchLayout(MERGE_WINDOW, 14, 2, 2),
                    "bicubic", "black", torch.ones(3), torch.zeros(3), DEVICE, [1, 1])
