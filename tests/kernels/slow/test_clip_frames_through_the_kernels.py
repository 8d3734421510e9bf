"""Clips' frames through the batch's one Triton launch with its images, against the torch path and the families' HF
processors: compiled on CUDA (`jobs/gpu_check.sh` runs this file on a GPU), interpreted without one, on tiny frames."""

from __future__ import annotations

import copy
import hashlib
import json
import shutil

import torch
# first: the unit file sets TRITON_INTERPRET without a GPU, before anything imports kernels/pack_pixels.py
from test_pack_frames import DEVICE

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from photos import photo_of_size  # noqa: E402

from batchvlm.families import ModelConfig, load_family  # noqa: E402
from batchvlm.families.siglip2 import VIDEO_PROCESSOR_CONFIG  # noqa: E402
from batchvlm.format.layouts import MERGE_WINDOW, PatchLayout  # noqa: E402
from batchvlm.pipeline.preprocess import (TorchPreprocessor, TritonPreprocessor, clip_rows,  # noqa: E402
                                          preprocess_batch)
from batchvlm.records import DecodedClip, DecodedImage, PreparedRecord, SourceRecord, TokenLayout  # noqa: E402

# the Triton interpreter without a GPU
pytestmark = pytest.mark.slow


LEVELS = 2.0
"""The GPU float resize's distance from PIL's uint8 kernel (tests/kernels/test_pack_pixels.py measures it: 2 levels);
the images' parity default (preprocess.parity_max_levels) is 3."""


@pytest.fixture(scope="module")
def siglip(tmp_path_factory):
    """The tiny SigLIP2 checkpoint whose clips take 16 patches a frame (small enough for the interpreter)."""
    folder = tmp_path_factory.mktemp("siglip2_frames")
    shutil.copytree(load_family(ModelConfig(family="siglip2")).checkpoint, folder, dirs_exist_ok=True)
    (folder / VIDEO_PROCESSOR_CONFIG).write_text(json.dumps({"fps": 2.0, "max_frames": 4, "max_num_patches": 16}))
    return load_family(ModelConfig(family="siglip2", path=str(folder)))


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    """The tiny Kimi-K2.5 checkpoint whose clips share 60 patches a chunk (in_patch_limit_video): a chunk of four
    frames is resized down to 15 patches a frame, a chunk of one keeps its frame's size."""
    folder = tmp_path_factory.mktemp("kimi_frames")
    shutil.copytree(load_family(ModelConfig()).checkpoint, folder, dirs_exist_ok=True)
    config = json.loads((folder / "preprocessor_config.json").read_text())
    config["media_proc_cfg"] |= {"in_patch_limit_video": 60}
    (folder / "preprocessor_config.json").write_text(json.dumps(config))
    return load_family(ModelConfig(path=str(folder)))


def moving_frames(count: int, height: int, width: int) -> np.ndarray:
    """Frames of a real photo that differ frame to frame (a pan), so a frame taken for another would show."""
    photo = photo_of_size(height, width + 3 * count)
    return np.stack([photo[:, 3 * index:3 * index + width] for index in range(count)])


def record_with(family, frames: np.ndarray, plan, image: np.ndarray) -> PreparedRecord:
    source = SourceRecord(id="r", unit_id="u", source="s", row=0, text="", images=[])
    decoded = DecodedImage(image, "PNG", hashlib.sha256(image.tobytes()).hexdigest())
    clip = DecodedClip(frames, tuple(range(len(frames))), tuple(i / 2 for i in range(len(frames))), len(frames), 2.0)
    return PreparedRecord(source, [decoded], [family.plan(*image.shape[:2])], TokenLayout([], [], []), clips=[clip],
                          clip_plans=[plan])


def levels(family, ours: torch.Tensor, oracle: torch.Tensor) -> float:
    """Largest difference in uint8 levels (a level is the value's channel scale, laid out as a row)."""
    row_scale = TorchPreprocessor(family, torch.device("cpu"), "black").row_scale
    return float(((ours.cpu() - oracle).abs() / row_scale).max())


def launches(monkeypatch, backend: TritonPreprocessor) -> list[int]:
    """How many images (frames included) each pack_images call of the backend took."""
    calls, pack = [], backend.pack_images

    def counted(images, *args):
        calls.append(len(images))
        return pack(images, *args)

    monkeypatch.setattr(backend, "pack_images", counted)
    return calls


def test_kimi_chunk_frames_go_through_the_images_launch_and_match_the_torch_path_and_the_video_processor(
        kimi, monkeypatch):
    family = kimi
    frames = moving_frames(5, 60, 90)
    plan = family.plan_video(list(range(5)), 5, 2.0, 60, 90)
    assert [len(chunk.frames) for chunk in plan.chunks] == [4, 1]
    assert plan.chunks[0].plan.resized < (60, 90) == plan.chunks[1].plan.resized
    record = record_with(family, frames, plan, photo_of_size(30, 40))
    backend = TritonPreprocessor(family, DEVICE, "black")
    calls = launches(monkeypatch, backend)
    image_rows, _, (rows,) = backend([record])
    assert calls == [1 + 5]  # the image and the clip's five frames, one packed batch
    assert rows.shape[0] == plan.num_patches
    assert levels(family, rows, clip_rows(torch.from_numpy(frames), plan, family)) <= LEVELS
    assert levels(family, rows, family.reference_clip_rows(frames, plan)) <= LEVELS
    torch_image, _ = TorchPreprocessor(family, torch.device("cpu"), "black").image_rows(record.images[0],
                                                                                       record.plans[0])
    assert levels(family, image_rows[0], torch_image) <= LEVELS


def test_siglip2_frames_go_through_the_images_launch_and_match_the_torch_path_and_the_image_processor(
        siglip, monkeypatch):
    frames = moving_frames(3, 40, 70)
    plan = siglip.plan_video([0, 1, 2], 3, 2.0, 40, 70)
    record = record_with(siglip, frames, plan, photo_of_size(20, 36))
    backend = TritonPreprocessor(siglip, DEVICE, "black")
    calls = launches(monkeypatch, backend)
    batch = preprocess_batch([record], backend)
    assert calls == [1 + 3]
    image_patches = record.plans[0].num_patches
    rows = batch.pixel_values[image_patches:]
    assert rows.shape[0] == plan.num_patches == 3 * 16 - 3 * (16 - plan.grid_thw[1] * plan.grid_thw[2])
    assert levels(siglip, rows, clip_rows(torch.from_numpy(frames), plan, siglip)) <= LEVELS
    assert levels(siglip, rows, siglip.reference_clip_rows(frames, plan)) <= LEVELS


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """The tiny Qwen2-VL checkpoint whose clips' frames hold 4 to 16 merge windows (video_preprocessor_config.json)."""
    folder = tmp_path_factory.mktemp("qwen_frames")
    shutil.copytree(load_family(ModelConfig(family="qwen2_vl")).checkpoint, folder, dirs_exist_ok=True)
    (folder / "video_preprocessor_config.json").write_text(json.dumps(
        {"size": {"shortest_edge": 28 * 28 * 4, "longest_edge": 28 * 28 * 16}}))
    return load_family(ModelConfig(family="qwen2_vl", path=str(folder)))


def test_qwen_temporal_pairs_take_two_frames_in_the_images_launch_and_match_the_video_processor(qwen, monkeypatch):
    """A Qwen temporal patch holds two different frames, each time slice from its own (five frames: the last one in
    both slices of its patch, as the video processor pads it), resized in the kernel."""
    frames = moving_frames(5, 60, 90)
    plan = qwen.plan_video(list(range(5)), 5, 2.0, 60, 90)
    assert plan.resized != (60, 90) and plan.grid_thw[0] == 3
    record = record_with(qwen, frames, plan, photo_of_size(28, 56))
    backend = TritonPreprocessor(qwen, DEVICE, "black")
    calls = launches(monkeypatch, backend)
    image_rows, _, (rows,) = backend([record])
    assert calls == [1 + 5]
    assert rows.shape[0] == plan.num_patches
    assert levels(qwen, rows, clip_rows(torch.from_numpy(frames), plan, qwen)) <= LEVELS
    assert levels(qwen, rows, qwen.reference_clip_rows(frames, plan)) <= LEVELS
    torch_image, _ = TorchPreprocessor(qwen, torch.device("cpu"), "black").image_rows(record.images[0],
                                                                                      record.plans[0])
    assert levels(qwen, image_rows[0], torch_image) <= LEVELS  # a still image: both slices its own


def test_a_clip_whose_rows_hold_more_than_two_frames_stays_on_torch_ops(qwen, monkeypatch):
    """A layout of three time slices (no released family has one): the kernels pair frames only, so such a clip's
    rows are clip_rows' under triton, its images still in the launch."""
    family = copy.copy(qwen)
    family.layout = PatchLayout(MERGE_WINDOW, 14, 2, 3)
    frames = moving_frames(6, 56, 84)
    plan = qwen.plan_video(list(range(6)), 6, 2.0, 56, 84)
    record = record_with(family, frames, plan, photo_of_size(28, 56))
    backend = TritonPreprocessor(family, DEVICE, "black")
    calls = launches(monkeypatch, backend)
    _, _, (rows,) = backend([record])
    assert calls == [1]
    assert torch.equal(rows.cpu(), clip_rows(torch.from_numpy(frames), plan, family))
