"""The Triton kernels against their plain-torch reference, and a wrong kernel grid redone on the CPU path or
quarantined: compiled on CUDA (`jobs/gpu_check.sh` runs this file on a GPU), interpreted without one (TRITON_INTERPRET=1)."""

from __future__ import annotations

import hashlib

import torch
# first: the unit file sets TRITON_INTERPRET without a GPU, before anything imports kernels/pack_pixels.py
from test_pack_pixels import BIAS, DEVICE, LAYOUTS, M, P, SCALE, SIZES, random_images

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from batchvlm.checks import CheckFailed  # noqa: E402
from batchvlm.kernels.pack_pixels import pack_images  # noqa: E402
from batchvlm.kernels.reference import normalized_image  # noqa: E402
from batchvlm.format.layouts import MERGE_WINDOW, RASTER_CHW, RASTER_HWC, PatchLayout  # noqa: E402
from batchvlm.pipeline.preprocess import (PreprocessGuard, TorchPreprocessor, TritonPreprocessor,  # noqa: E402
                                          preprocess_batch)
from batchvlm.records import DecodedImage, ImagePlan, PreparedRecord, SourceRecord, TokenLayout  # noqa: E402

# the Triton interpreter without a GPU
pytestmark = pytest.mark.slow


def padded_to(size: tuple[int, int], layout: PatchLayout) -> tuple[int, int]:
    factor = P * M  # whole merge windows suit all three layouts
    return tuple(-(-side // factor) * factor for side in size)


def reference_rows(images, layout: PatchLayout, resample: str, background: str) -> torch.Tensor:
    rows = []
    for image, (_, resized) in zip(images, SIZES):
        normalized = normalized_image(image, resized, padded_to(resized, layout), resample, background,
                                      SCALE.view(3, 1, 1), BIAS.view(3, 1, 1))
        rows.append(layout.patchify(normalized))
    return torch.cat(rows)


def level_of_each_value(layout: PatchLayout) -> torch.Tensor:
    """One uint8 level in normalized units (SCALE of the value's channel), laid out like the packed rows."""
    channel = torch.arange(3).view(3, 1, 1)
    return torch.cat([SCALE[layout.patchify(channel.expand(3, *padded_to(resized, layout)))]
                      for _, resized in SIZES])


@pytest.mark.parametrize("kind,resample,background", [
    (RASTER_CHW, "bicubic", "black"), (RASTER_CHW, "bicubic", "chessboard"), (MERGE_WINDOW, "bicubic", "white"),
    (RASTER_HWC, "bilinear", "gray"), (RASTER_HWC, "bicubic", "chessboard"), (MERGE_WINDOW, "bilinear", "black")])
def test_kernels_equal_the_torch_reference_within_one_level(kind, resample, background):
    layout = LAYOUTS[kind]
    images = random_images(seed=len(kind) + len(background))
    packed, rows = pack_images(images, [resized for _, resized in SIZES],
                               [padded_to(resized, layout) for _, resized in SIZES], layout, resample, background,
                               SCALE, BIAS, DEVICE)
    expected = reference_rows(images, layout, resample, background)
    assert rows == [h * w // (P * P) for h, w in (padded_to(resized, layout) for _, resized in SIZES)]
    assert packed.shape == expected.shape
    levels = (packed.cpu() - expected).abs() / level_of_each_value(layout)
    assert float(levels.max()) <= 1.0 + 1e-3
    assert float((levels > 1e-3).float().mean()) < 0.01  # off by a level only where rounding sits on a tie


# -- the triton backend inside pack(): its checks and the CPU fallback ------------------------
class TinyFamily:
    """The pixel side of a family, small enough for the interpreter: Kimi's layout and size rule."""

    resample = "bicubic"
    image_mean = (0.5, 0.5, 0.5)
    image_std = (0.5, 0.5, 0.5)
    layout = LAYOUTS[RASTER_CHW]

    def patchify(self, image):
        return self.layout.patchify(image)

    def grid_of(self, image):
        return (1, image.shape[1] / P, image.shape[2] / P)


def tiny_record(record_id: str, pixels: np.ndarray, resized: tuple[int, int]) -> PreparedRecord:
    padded = padded_to(resized, TinyFamily.layout)
    plan = ImagePlan(original=pixels.shape[:2], resized=resized, padded=padded, grid_thw=(1, padded[0] // P,
                     padded[1] // P), num_tokens=padded[0] * padded[1] // (P * P * M * M))
    source = SourceRecord(id=record_id, unit_id="u", source="s", row=0, text="", images=[])
    image = DecodedImage(pixels, "PNG", hashlib.sha256(record_id.encode()).hexdigest())
    return PreparedRecord(source=source, images=[image], plans=[plan], layout=TokenLayout([], [], []))


def tiny_batch() -> list[PreparedRecord]:
    return [tiny_record(f"r{i}", image.numpy(), resized) for i, (image, (_, resized)) in
            enumerate(zip(random_images(seed=3), SIZES))]


def test_a_wrong_kernel_grid_is_redone_on_the_cpu_path_and_counted(monkeypatch):
    family, records = TinyFamily(), tiny_batch()
    triton_backend = TritonPreprocessor(family, DEVICE, "black")
    clean = preprocess_batch(records, triton_backend)
    monkeypatch.setenv("BATCHVLM_FAULTS", f"preprocess.wrong_grid={records[1].images[0].sha256[:12]}")
    guard = PreprocessGuard(cpu=TorchPreprocessor(family, torch.device("cpu"), "black"), fallback=True)
    redone = preprocess_batch(records, triton_backend, guard)
    assert [index for index, record in enumerate(records) if record.preprocess.fallbacks] == [1]
    assert records[1].preprocess.fallbacks == {0: "preprocess.grid_match"}
    assert records[1].preprocess.counts()["fallbacks"] == {"preprocess.grid_match": 1}
    offsets = np.cumsum([0] + [r.num_patches for r in records])
    cpu_rows, _ = guard.cpu.image_rows(records[1].images[0], records[1].plans[0])
    assert torch.equal(redone.pixel_values[offsets[1]:offsets[2]].cpu(), cpu_rows)
    outside = torch.ones(offsets[-1], dtype=torch.bool)
    outside[offsets[1]:offsets[2]] = False
    assert torch.equal(redone.pixel_values[outside], clean.pixel_values[outside])  # the others unchanged


def test_a_wrong_kernel_grid_quarantines_its_record_without_fallback(monkeypatch):
    records = tiny_batch()
    monkeypatch.setenv("BATCHVLM_FAULTS", f"preprocess.wrong_grid={records[2].images[0].sha256[:12]}")
    with pytest.raises(CheckFailed) as caught:
        preprocess_batch(records, TritonPreprocessor(TinyFamily(), DEVICE, "black"), PreprocessGuard(fallback=False))
    assert caught.value.check == "preprocess.grid_match" and caught.value.record is records[2]
