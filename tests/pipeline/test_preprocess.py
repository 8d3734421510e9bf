"""Preprocessing on its own: the torch backend's fast path (uint8 until the rows, normalized where the values are
fewest) against the pixel contract written out step by step in float (kernels/reference.py, the Triton kernels'
oracle); the guard's sampled parity check, which catches pixels that drift while every shape stays right, and its
CPU fallback, noted on the record; the backend chosen for the device."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from skimage import data

from batchvlm.bench.tasks import image_mix
from batchvlm.checks import CheckFailed
from batchvlm.config import ConfigError
from batchvlm.pipeline.preprocess import PreprocessConfig
from batchvlm.devices import Syncs
from batchvlm.kernels.reference import normalized_image
from batchvlm.pipeline.preprocess import (PreprocessGuard, TorchPreprocessor, merged_stats, preprocess_batch,
                                          resolve_backend)
from batchvlm.records import DecodedClip, DecodedImage, PreparedRecord, SourceRecord, TokenLayout


@pytest.mark.parametrize("background", ["black", "chessboard"])
def test_torch_rows_equal_the_float_reference_bit_for_bit(family, background):
    """Every family, on kept sizes, down- and upscales, padding, a thin strip and column, and RGBA."""
    preprocessor = TorchPreprocessor(family, torch.device("cpu"), background)
    mix = image_mix()
    coffee = dict(mix)["coffee"]
    height, width = family.plan(*coffee.shape[:2]).resized
    resized_or_not = set()
    for name, pixels in mix + [("coffee_at_its_planned_size", coffee[:height, :width].copy())]:
        image = DecodedImage(pixels, "PNG", "")
        plan = family.plan(image.height, image.width)
        resized_or_not.add(plan.resized == (image.height, image.width))
        rows, grid = preprocessor.image_rows(image, plan)
        expected = family.patchify(normalized_image(torch.from_numpy(pixels), plan.resized, plan.padded,
                                                    family.resample, background, preprocessor.scale,
                                                    preprocessor.bias))
        assert grid == (1, plan.padded[0] / family.layout.patch_size, plan.padded[1] / family.layout.patch_size)
        assert rows.dtype == torch.float32 and torch.equal(rows, expected), name
    assert resized_or_not == {True, False}, "the mix must hold kept and resized images"


# -- parity -----------------------------------------------------------------------------------
def first_image_of(records: list[PreparedRecord], record_id: str) -> int:
    """The batch-wide index of a record's first image."""
    return [image for r in records for image in [r.source.id] * len(r.images)].index(record_id)


class BrightenOne:
    """A backend whose pixels for one record are 5 levels too bright: shapes right, values wrong."""

    def __init__(self, inner, record_id):
        self.inner, self.record_id = inner, record_id

    def __call__(self, records):
        rows, grids, clips = self.inner(records)
        index = first_image_of(records, self.record_id)
        rows[index] = rows[index] + 5 * float(self.inner.scale.flatten()[0])
        return rows, grids, clips


def photo_records(family) -> list[PreparedRecord]:
    crops = {"cat": data.chelsea()[100:160, 150:250], "cup": data.coffee()[50:120, 200:260],
             "rocket": data.rocket()[150:190, 100:300]}
    records = []
    for record_id, pixels in crops.items():
        image = DecodedImage(np.ascontiguousarray(pixels), "PNG", hashlib.sha256(pixels.tobytes()).hexdigest())
        source = SourceRecord(id=record_id, unit_id="u", source="s", row=0, text="", images=[])
        records.append(PreparedRecord(source, [image], [family.plan(image.height, image.width)],
                                      TokenLayout([], [], [])))
    return records


@pytest.mark.parametrize("fallback", [True, False])
def test_parity_catches_drifting_pixels_and_falls_back_or_quarantines(kimi_family, fallback):
    records = photo_records(kimi_family)
    backend = TorchPreprocessor(kimi_family, torch.device("cpu"), "black")
    guard = PreprocessGuard(cpu=TorchPreprocessor(kimi_family, torch.device("cpu"), "black"), fallback=fallback,
                            parity_sample_rate=1.0)
    if not fallback:
        with pytest.raises(CheckFailed) as caught:
            preprocess_batch(records, BrightenOne(backend, "cup"), guard)
        assert caught.value.check == "preprocess.parity" and caught.value.record is records[1]
        return
    packed = preprocess_batch(records, BrightenOne(backend, "cup"), guard)
    assert torch.equal(packed.pixel_values, preprocess_batch(records, backend).pixel_values)
    events = merged_stats([record.preprocess.counts() for record in records])
    assert events == {"fallbacks": {"preprocess.parity": 1}, "parity": {"checked_images": 3, "failed_images": 1}}


class LeaveOneValueUnwritten:
    """A backend that misses one value of one record's rows (the Triton output starts as NaN)."""

    def __init__(self, inner, record_id):
        self.inner, self.record_id = inner, record_id

    def __call__(self, records):
        rows, grids, clips = self.inner(records)
        index = first_image_of(records, self.record_id)
        rows[index] = rows[index].clone()
        rows[index].view(-1)[7] = float("nan")
        return rows, grids, clips


def test_unwritten_values_are_caught_and_redone_on_the_cpu_path(kimi_family):
    """Read at once (the checked path, with the Syncs seam): the image is redone; left on the device (the overlapped
    path), its flag rides on the batch to the tower's read-back (tests/pipeline/test_encode.py)."""
    records = photo_records(kimi_family)
    backend = TorchPreprocessor(kimi_family, torch.device("cpu"), "black")
    guard = PreprocessGuard(cpu=TorchPreprocessor(kimi_family, torch.device("cpu"), "black"), fallback=True)
    deferred = preprocess_batch(records, LeaveOneValueUnwritten(backend, "rocket"), guard)
    assert deferred.finite.tolist() == [True, True, False] and not records[2].preprocess.counts()["fallbacks"]
    syncs = Syncs()
    packed = preprocess_batch(records, LeaveOneValueUnwritten(backend, "rocket"), guard, syncs)
    assert torch.equal(packed.pixel_values, preprocess_batch(records, backend).pixel_values)
    assert records[2].preprocess.counts()["fallbacks"] == {"preprocess.feature_length": 1}
    assert packed.finite is None and syncs.waits == 1


def test_parity_sampling_is_deterministic_by_content():
    guard = PreprocessGuard(parity_sample_rate=0.25)
    digests = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(400)]
    picks = [guard.sampled(DecodedImage(np.zeros((1, 1, 3), np.uint8), "PNG", d)) for d in digests]
    assert picks == [guard.sampled(DecodedImage(np.zeros((1, 1, 3), np.uint8), "PNG", d)) for d in digests]
    assert 60 < sum(picks) < 140


# -- clips: the parity sample against the family's HF processor, the CPU fallback --------------------------------
class SpoilClip:
    """A backend whose rows for the batch's first clip are wrong: 5 levels too bright (shapes right), or a row short."""

    def __init__(self, inner, how: str):
        self.inner, self.how = inner, how

    def __call__(self, records):
        rows, grids, clips = self.inner(records)
        if self.how == "brighter":
            clips[0] = clips[0] + 5 * float(self.inner.scale.flatten()[0])
        else:
            clips[0] = clips[0][:-1]
        return rows, grids, clips


def clip_records(family) -> list[PreparedRecord]:
    """Two records, each an image and a clip of five frames (Kimi-K2.5: chunks of 4 and 1)."""
    records = photo_records(family)[:2]
    for record, shift in zip(records, (0, 7)):
        photo = np.ascontiguousarray(data.astronaut()[100:160, 100:210])
        frames = np.stack([np.roll(photo, shift + 3 * index, axis=1)[:, :90] for index in range(5)])
        record.clips = [DecodedClip(frames, tuple(range(5)), tuple(i / 2 for i in range(5)), 5, 2.0)]
        record.clip_plans = [family.plan_video(list(range(5)), 5, 2.0, 60, 90)]
    return records


def test_each_familys_clip_oracle_holds_the_jobs_clip_rows(family):
    """family.reference_clip_rows (the transformers processor its clip rule names, on the sampled frames: the parity
    sample's oracle) against the job's clip_rows: the same rows to float rounding, five frames (an odd count)."""
    from batchvlm.pipeline.preprocess import clip_rows

    (record, _) = clip_records(family)
    frames, plan = record.clips[0].pixels, record.clip_plans[0]
    oracle = family.reference_clip_rows(frames, plan)
    assert oracle.shape[0] == plan.num_patches
    torch.testing.assert_close(clip_rows(torch.from_numpy(frames), plan, family), oracle, atol=1e-4, rtol=0)


def test_a_sampled_clip_within_the_video_processors_levels_passes_and_is_counted(kimi_family):
    records = clip_records(kimi_family)
    backend = TorchPreprocessor(kimi_family, torch.device("cpu"), "black")
    guard = PreprocessGuard(cpu=TorchPreprocessor(kimi_family, torch.device("cpu"), "black"), fallback=False,
                            parity_sample_rate=1.0)
    preprocess_batch(records, backend, guard)
    assert [record.preprocess.parity_checked for record in records] == [{0, 1}, {0, 1}]  # media: the image, the clip
    assert merged_stats([record.preprocess.counts() for record in records])["parity"] == {
        "checked_images": 4, "failed_images": 0}


@pytest.mark.parametrize("how,check", [("brighter", "preprocess.parity"), ("short", "preprocess.feature_length")])
def test_a_clips_wrong_backend_rows_are_redone_on_the_cpu_path(kimi_family, how, check):
    records = clip_records(kimi_family)
    backend = TorchPreprocessor(kimi_family, torch.device("cpu"), "black")
    guard = PreprocessGuard(cpu=TorchPreprocessor(kimi_family, torch.device("cpu"), "black"), fallback=True,
                            parity_sample_rate=1.0)
    packed = preprocess_batch(records, SpoilClip(backend, how), guard)
    assert torch.equal(packed.pixel_values, preprocess_batch(records, backend).pixel_values)
    assert records[0].preprocess.fallbacks == {1: check} and not records[1].preprocess.fallbacks
    assert merged_stats([record.preprocess.counts() for record in records])["fallbacks"] == {check: 1}


@pytest.mark.parametrize("how,check", [("brighter", "preprocess.parity"), ("short", "preprocess.feature_length")])
def test_a_clips_wrong_backend_rows_quarantine_its_record_naming_the_clip_without_fallback(kimi_family, how, check):
    records = clip_records(kimi_family)
    backend = TorchPreprocessor(kimi_family, torch.device("cpu"), "black")
    guard = PreprocessGuard(cpu=TorchPreprocessor(kimi_family, torch.device("cpu"), "black"), fallback=False,
                            parity_sample_rate=1.0)
    with pytest.raises(CheckFailed) as caught:
        preprocess_batch(records, SpoilClip(backend, how), guard)
    assert (caught.value.check, caught.value.record, caught.value.video_index) == (check, records[0], 0)
    assert caught.value.image_index is None


def test_clip_parity_sampling_is_deterministic_by_record_and_clip(kimi_family):
    guard = PreprocessGuard(cpu=TorchPreprocessor(kimi_family, torch.device("cpu"), "black"), parity_sample_rate=0.25)
    records = [PreparedRecord(SourceRecord(id=f"r{i}", unit_id="u", source="s", row=0, text="", images=[]), [], [],
                              TokenLayout([], [], [])) for i in range(200)]
    picks = [guard.sampled_clip(record, index) for record in records for index in (0, 1)]
    assert picks == [guard.sampled_clip(record, index) for record in records for index in (0, 1)]
    assert 60 < sum(picks) < 140


def test_auto_is_the_backend_measured_faster_on_the_gpu_torch_and_torch_elsewhere():
    assert resolve_backend("auto", torch.device("cuda", 0)) == "torch"
    assert resolve_backend("triton", torch.device("cuda", 0)) == "triton"
    assert resolve_backend("auto", torch.device("cpu")) == "torch"
    assert resolve_backend("reference", torch.device("cuda", 0)) == "reference"


def test_triton_without_a_gpu_is_refused_naming_the_key(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match=r"preprocess\.backend=triton needs a CUDA device"):
        resolve_backend("triton", torch.device("cpu"))


@pytest.mark.parametrize("values,key", [({"backend": "cuda"}, "preprocess.backend"),
                                        ({"fallback": "drop"}, "preprocess.fallback"),
                                        ({"parity_sample_rate": 1.5}, "preprocess.parity_sample_rate"),
                                        ({"parity_max_levels": 0}, "preprocess.parity_max_levels")])
def test_bad_preprocess_values_fail_naming_the_key(values, key):
    with pytest.raises(ConfigError, match=key):
        PreprocessConfig(**values)
