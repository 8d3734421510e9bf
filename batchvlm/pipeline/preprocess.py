"""Preprocessing: decoded images of many records -> one packed pixel tensor in the tower's layout.

Backends (`preprocess.backend`): `triton` (kernels/pack_pixels.py: the whole batch in two launches),
`torch` (kernels/reference.py in torch ops, on the job's device) and `reference` (the family's
Hugging Face image processor, the oracle); `auto` is torch, the faster of the two on an H200 for every family
(`python jobs/bench.py task=preprocess`: triton/torch 0.93x Kimi, 0.51x Qwen2-VL, 0.74x SigLIP2), and the only one
elsewhere. The resolved backend is in the run's fingerprint: the two differ by up to a level.

Every image is checked against its plan whichever backend ran, and a deterministic sample of
images is compared with the HF processor (parity). An image that fails is redone on the CPU path
(`preprocess.fallback=cpu`) or its record quarantined (`quarantine`); `PreprocessGuard` notes either on the record.
Clips alike: each backend returns their rows with the images' (triton: their frames in the images' launch,
`kernel_frames`), checked, sampled against the family's HF processor (`reference_clip_rows`) and redone by `clip_rows`.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import ClassVar
import logging
import os
from collections import Counter
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from batchvlm.checks import CheckFailed, require
from batchvlm.config import Choice, Config, ConfigError, operational, positive, written
from batchvlm.faults import fault
from batchvlm.kernels.reference import composite, resize_image
from batchvlm.devices import Syncs, images_on, to_device
from batchvlm.records import DecodedImage, ImagePlan, PixelBatch, PreparedRecord, PreprocessStats


class Backend(Choice):
    auto = "auto"
    triton = "triton"
    torch = "torch"
    reference = "reference"


class Background(Choice):
    black = "black"
    white = "white"
    gray = "gray"
    chessboard = "chessboard"


class Fallback(Choice):
    cpu = "cpu"
    quarantine = "quarantine"


@dataclass
class PreprocessConfig(Config):
    KEY: ClassVar[str] = "preprocess"

    backend: Backend = written(Backend.auto)
    """auto (torch: measured faster than triton on an H200 for every family) | triton (kernels/, fused, GPU) | torch
    (batchvlm's own ops, CPU or GPU) | reference (the family's Hugging Face processor). Their pixels differ by a
    level."""
    token_budget: int = operational(16384)
    """Patches per packed batch; an image larger than the budget is encoded alone."""
    max_images_per_batch: int = operational(256)
    background: Background = written(Background.black)
    """Background that transparent pixels are composited onto: black | white | gray | chessboard."""
    fallback: Fallback = written(Fallback.cpu)
    """An image or clip whose backend result fails a preprocess check: cpu (redone on the CPU torch path, counted in
    the run's totals) | quarantine (its record is quarantined under the check)."""
    parity_sample_rate: float = written(0.001)
    """Fraction of images (chosen by content hash, so reruns pick the same) and of clips (by record id and clip index)
    also run through the family's HF processor and compared with the backend (check preprocess.parity). The HF
    processor runs on the CPU."""
    parity_max_levels: float = written(3.0)
    """Largest pixel difference from the HF processor that parity accepts, in uint8 levels."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.parity_sample_rate <= 1.0:
            raise ConfigError(f"preprocess.parity_sample_rate={self.parity_sample_rate} must be in [0, 1]")
        positive("preprocess.parity_max_levels", self.parity_max_levels)
        positive("preprocess.token_budget", self.token_budget)
        positive("preprocess.max_images_per_batch", self.max_images_per_batch)


log = logging.getLogger("batchvlm")


def resolve_backend(backend: str, device: torch.device) -> str:
    """`auto`: torch ops, the faster on a GPU for every family as measured (the module's notes), and the only choice
    on the CPU (Triton runs there only interpreted)."""
    if backend == "auto":
        return "torch"
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError(f"preprocess.backend=triton needs a CUDA device, and the job runs on {device} "
                          "(model.device); use preprocess.backend=auto or torch, or TRITON_INTERPRET=1 to debug")
    return backend


def normalization(family, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel (scale, bias) with x*scale + bias == (x/255 - mean)/std, computed in float64."""
    mean = torch.tensor(family.image_mean, dtype=torch.float64)
    std = torch.tensor(family.image_std, dtype=torch.float64)
    return (1.0 / (255.0 * std)).float().to(device), (-mean / std).float().to(device)


def backend_plan(image: DecodedImage, plan: ImagePlan, layout) -> ImagePlan:
    """The plan a backend works to: the image's own, unless a test forces a wrong grid on the backend
    (fault `preprocess.wrong_grid=<sha256 prefix>`: one merge window wider). The CPU fallback path
    reads the plan itself, so it stays right."""
    target = fault("preprocess.wrong_grid")
    if target and image.sha256.startswith(target):
        wider = plan.padded[1] + layout.patch_size * layout.merge_size
        return dataclasses.replace(plan, padded=(plan.padded[0], wider))
    return plan


def backend_clip_rows(clips: list, rows: list[torch.Tensor]) -> list[torch.Tensor]:
    """The backend's rows of each clip: as it returned them, unless a test forces a wrong result (fault
    `preprocess.wrong_clip=<record id>`: that record's clips one row short). The CPU fallback path makes its own, so
    it stays right."""
    target = fault("preprocess.wrong_clip")
    if not target:
        return rows
    return [part[:-1] if record.source.id == target else part for (record, *_), part in zip(clips, rows)]


def _resized(image: torch.Tensor, size: tuple[int, int], mode: str) -> torch.Tensor:
    """reference.resize_image, but left in uint8 on the CPU, where torch runs PIL's own uint8 algorithm; elsewhere
    its float passes, whose values are whole numbers (each pass rounds and clamps)."""
    if image.device.type == "cpu":
        return F.interpolate(image[None], size=size, mode=mode, align_corners=False, antialias=True)[0]
    return resize_image(image, size, mode)


def frame_rows(frames: torch.Tensor, resized: tuple[int, int], layout, norm, resample: str) -> torch.Tensor:
    """A clip's sampled frames, (n, H, W, 3) uint8, as the rows of a layout with frames (Qwen's merge windows; SigLIP2's
    raster, a frame a temporal patch): each frame resized as an image is (uint8 on the CPU), an odd count padded with
    its last frame, normalized by `norm` (an object with image_mean and image_std), then patchified a temporal patch at
    a time (PatchLayout.patchify_frames)."""
    images = frames.permute(0, 3, 1, 2)
    if tuple(images.shape[2:]) != resized:
        images = torch.stack([_resized(image, resized, resample) for image in images])
    if pad := -images.shape[0] % layout.temporal_patch_size:
        images = torch.cat([images, images[-1:].expand(pad, *images.shape[1:])])
    scale, bias = (t.view(3, 1, 1) for t in normalization(norm, images.device))
    return layout.patchify_frames(images.float().mul_(scale).add_(bias))


def clip_rows(frames: torch.Tensor, plan, family) -> torch.Tensor:
    """A clip's sampled frames as the tower's rows: a clip in parts (records.clip_parts: Kimi-K2.5's chunks) part by
    part, each part's frames (its grid's t) as images at the part's plan (an image's own rows: TorchPreprocessor); any
    other clip by frame_rows."""
    if not hasattr(plan, "parts"):
        return frame_rows(frames, plan.resized, family.layout, family, family.resample)
    as_images = TorchPreprocessor(family, frames.device, "black")  # frames are RGB: no background shows
    counts = [part.grid_thw[0] for part in plan.parts]
    return torch.cat([as_images.rows_of(frame, part)[0]
                      for part, part_frames in zip(plan.parts, torch.split(frames, counts)) for frame in part_frames])


def kernel_frames(plan, family, count: int) -> list[tuple[tuple[int, int], tuple[int, int], int]] | None:
    """Each of a clip's `count` frames as the Triton kernels take it with the batch's images: (resized, padded, 1 where
    the next frame fills the second time slice of its rows, else 0). Laid out as images: Kimi-K2.5's at their chunk's
    plan, SigLIP2's (a frame a temporal patch) at the clip's size. In pairs: Qwen's temporal patches of two frames
    (never padded), an odd last frame in both slices as frame_rows pads it. None where a row holds more frames."""
    if hasattr(plan, "parts"):
        return [(part.resized, part.padded, 0) for part in plan.parts for _ in range(part.grid_thw[0])]
    tps = family.layout.temporal_patch_size
    if tps > 2:
        return None
    return [(plan.resized, plan.resized, int(tps == 2 and frame % 2 == 0 and frame + 1 < count))
            for frame in range(count)]


def clips_of(records: list[PreparedRecord]) -> list[tuple[PreparedRecord, int, object, object]]:
    """(record, clip index, DecodedClip, its plan) of every clip of the batch, in batch order."""
    return [(record, index, clip, plan) for record in records
            for index, (clip, plan) in enumerate(zip(record.clips, record.clip_plans))]


def torch_clips_rows(clips: list, device: torch.device, family) -> list[torch.Tensor]:
    """Clips' rows by torch ops (`clip_rows`) on `device`, their frames crossing together."""
    frames = images_on([clip.pixels for _, _, clip, _ in clips], device) if clips else []
    return [clip_rows(clip_frames, plan, family) for (_, _, _, plan), clip_frames in zip(clips, frames)]


def pixels_on(image: DecodedImage, device: torch.device) -> torch.Tensor:
    """HWC uint8 on `device`: where the decoder left it (decode.jpeg=device), or copied there from the host."""
    pixels = image.pixels if isinstance(image.pixels, torch.Tensor) else torch.from_numpy(image.pixels)
    return to_device(pixels, device)


def images_and_plans(records: list[PreparedRecord]) -> tuple[list[DecodedImage], list[ImagePlan]]:
    return ([image for record in records for image in record.images],
            [plan for record in records for plan in record.plans])


class TorchPreprocessor:
    """The family's pixel contract in plain torch ops (kernels/reference.py), image by image.

    The image stays uint8 through padding and is normalized where it has the fewest values: as rows, after a
    uint8 patchify that moves a quarter of the bytes a float one would (Kimi, SigLIP2), or before patchify where
    a row repeats the image over frames (Qwen). Every value before normalization is an integer in 0..255 (the
    resize rounds and clamps, compositing floors), so the rows equal reference.normalized_image's patchified,
    bit for bit.
    """

    def __init__(self, family, device: torch.device, background: str):
        self.family = family
        self.device = device
        self.background = background
        self.scale, self.bias = (t.view(3, 1, 1) for t in normalization(family, device))
        self.row_scale, self.row_bias = (self._as_row(t) for t in (self.scale, self.bias))

    def _as_row(self, per_channel: torch.Tensor) -> torch.Tensor:
        """A (3, 1, 1) per-channel value laid out as one row of the family's layout (broadcasts over the rows)."""
        window = self.family.layout.patch_size * self.family.layout.merge_size
        return self.family.patchify(per_channel.expand(3, window, window))[:1]

    def padded_uint8(self, pixels: torch.Tensor, plan: ImagePlan) -> torch.Tensor:
        """HWC uint8 (RGB or RGBA) -> CHW uint8 at the padded size: resized, composited, padded with raw 0."""
        image = pixels.permute(2, 0, 1)
        # Kimi never scales up, so most images keep their size: a same-size resize is a whole filter pass for nothing.
        if tuple(image.shape[1:]) != plan.resized:
            image = _resized(image, plan.resized, self.family.resample)
        image = composite(image, self.background)
        if image.dtype == torch.uint8 and tuple(image.shape[1:]) == plan.padded:
            return image  # nothing to pad (Qwen and SigLIP2 never pad)
        # The canvas takes the image's memory layout (HWC as decoded, CHW once resized), so that filling it copies
        # whole rows; patchify reads either through a CHW view.
        channels_last = image.stride(0) == 1
        canvas = torch.zeros((*plan.padded, 3) if channels_last else (3, *plan.padded), dtype=torch.uint8,
                             device=pixels.device)
        canvas = canvas.permute(2, 0, 1) if channels_last else canvas
        canvas[:, :image.shape[1], :image.shape[2]] = image
        return canvas

    def normalized_rows(self, canvas: torch.Tensor) -> torch.Tensor:
        """The padded uint8 image as normalized rows, normalized where it has the fewest values."""
        if self.family.layout.temporal_patch_size > 1:
            # A still image is repeated in every frame of a row: normalize it once, before it is repeated.
            return self.family.patchify(canvas.float().mul_(self.scale).add_(self.bias))
        return self.family.patchify(canvas).float().mul_(self.row_scale).add_(self.row_bias)

    def image_rows(self, image: DecodedImage, plan: ImagePlan) -> tuple[torch.Tensor, tuple]:
        return self.rows_of(pixels_on(image, self.device), plan)

    def levels(self, ours: torch.Tensor, oracle: torch.Tensor, plan: ImagePlan) -> float | None:
        """Largest difference between two images' rows (on the host) in uint8 levels (one level is scale_c in
        normalized units, per channel); None where their shapes differ."""
        if ours.shape != oracle.shape:
            return None
        channel = torch.arange(3, dtype=torch.float32).view(3, 1, 1).expand(3, *plan.padded)
        scale = self.scale.cpu().view(3)[self.family.patchify(channel).long()]
        return float(((ours - oracle).abs() / scale).max()) if ours.numel() else 0.0

    def rows_of(self, pixels: torch.Tensor, plan: ImagePlan) -> tuple[torch.Tensor, tuple]:
        canvas = self.padded_uint8(pixels, plan)
        return self.normalized_rows(canvas), self.family.grid_of(canvas)

    def __call__(self, records: list[PreparedRecord]) -> tuple[list[torch.Tensor], list[tuple], list[torch.Tensor]]:
        images, plans = images_and_plans(records)
        rows, grids = [], []
        for image, pixels, plan in zip(images, images_on([image.pixels for image in images], self.device), plans):
            image_rows, grid = self.rows_of(pixels, backend_plan(image, plan, self.family.layout))
            rows.append(image_rows)
            grids.append(grid)
        return rows, grids, torch_clips_rows(clips_of(records), self.device, self.family)


class TritonPreprocessor:
    """kernels/pack_pixels.py: every image of the batch staged once, preprocessed in two launches, with the frames of
    its clips (`kernel_frames`: as images, or in pairs as Qwen's temporal patches); a clip whose rows hold more than
    two frames by torch ops."""

    def __init__(self, family, device: torch.device, background: str):
        # Imported here, not at the top: Triton fixes compiled vs interpreted when a kernel is defined.
        from batchvlm.kernels.pack_pixels import pack_images

        self.pack_images = pack_images
        self.family = family
        self.device = device
        self.background = background
        self.scale, self.bias = normalization(family, device)

    def __call__(self, records: list[PreparedRecord]) -> tuple[list[torch.Tensor], list[tuple], list[torch.Tensor]]:
        images, plans = images_and_plans(records)
        plans = [backend_plan(image, plan, self.family.layout) for image, plan in zip(images, plans)]
        clips = clips_of(records)
        framed = [kernel_frames(plan, self.family, len(clip.pixels)) for _, _, clip, plan in clips]
        taken = [(clip, sizes) for (_, _, clip, _), sizes in zip(clips, framed) if sizes is not None]
        frames = [frame for clip, _ in taken for frame in torch.as_tensor(clip.pixels).unbind(0)]
        sizes = [size for _, clip_sizes in taken for size in clip_sizes]
        # A still image is its own second time slice; a clip's frame that starts a pair has the next frame there.
        second_slice = (list(range(len(images))) + [len(images) + k + size[2] for k, size in enumerate(sizes)]
                        if any(size[2] for size in sizes) else None)
        packed, counts = self.pack_images([torch.as_tensor(image.pixels) for image in images] + frames,
                                          [plan.resized for plan in plans] + [size[0] for size in sizes],
                                          [plan.padded for plan in plans] + [size[1] for size in sizes],
                                          self.family.layout, self.family.resample, self.background, self.scale,
                                          self.bias, self.device, second_slice)
        rows = list(torch.split(packed, counts[:len(images)] + [sum(counts[len(images):])]))
        frames_rows = rows.pop()
        # The grid the kernel was told to write (`preprocess_batch` checks its rows: their count, and that every
        # value was written, since the output starts as NaN).
        grids = [self.family.grid_of(torch.empty((3, *plan.padded), device="meta")) for plan in plans]
        return rows, grids, self._clips_rows(clips, framed, frames_rows, counts[len(images):])

    def _clips_rows(self, clips: list, framed: list, frames_rows: torch.Tensor,
                    frame_counts: list[int]) -> list[torch.Tensor]:
        """Each clip's rows: its frames' from the packed batch, or torch ops' for a clip the kernels do not take."""
        counts = iter(frame_counts)
        packed = iter(torch.split(frames_rows, [sum(next(counts) for _ in sizes) for sizes in framed
                                                if sizes is not None]))
        others = iter(torch_clips_rows([clip for clip, sizes in zip(clips, framed) if sizes is None], self.device,
                                       self.family))
        return [next(packed) if sizes is not None else next(others) for sizes in framed]


class ReferencePreprocessor:
    """The family's Hugging Face image processor, image by image."""

    def __init__(self, family, device: torch.device):
        self.family = family
        self.device = device

    def __call__(self, records: list[PreparedRecord]) -> tuple[list[torch.Tensor], list[tuple], list[torch.Tensor]]:
        rows, grids = [], []
        for record in records:
            for image in record.images:
                pixel_values, grid = self.family.reference_preprocess([image.on_host()])
                rows.append(pixel_values.to(self.device))
                grids.append(tuple(int(v) for v in grid[0]))
        return rows, grids, torch_clips_rows(clips_of(records), self.device, self.family)


def make_preprocessor(backend: str, family, device: torch.device, background: str):
    """The backend's preprocessor; `backend` is already resolved (`resolve_backend`)."""
    if backend == "reference":
        return ReferencePreprocessor(family, device)
    if backend == "triton":
        return TritonPreprocessor(family, device, background)
    return TorchPreprocessor(family, device, background)


@dataclasses.dataclass
class PreprocessGuard:
    """Beyond the per-image checks: the sampled parity check against the HF processor, and what
    happens to an image that fails a check (redone on the CPU path, or its record quarantined).

    What it does to an image is written on its record (PreparedRecord.preprocess), by image index.
    """

    cpu: TorchPreprocessor | None = None
    """The CPU path: the fallback (None: quarantine) and the parity oracle for RGBA images."""
    fallback: bool = False
    parity_sample_rate: float = 0.0
    parity_max_levels: float = 3.0

    @classmethod
    def from_config(cls, config, family, background: str) -> "PreprocessGuard":
        return cls(cpu=TorchPreprocessor(family, torch.device("cpu"), background), fallback=config.fallback == "cpu",
                   parity_sample_rate=config.parity_sample_rate, parity_max_levels=config.parity_max_levels)

    def sampled(self, image: DecodedImage) -> bool:
        """Deterministic by content: a rerun samples the same images."""
        return self._in_sample(image.sha256)

    def sampled_clip(self, record: PreparedRecord, index: int) -> bool:
        """Deterministic by the record's id and the clip's place (a clip carries no content hash): a rerun samples the
        same clips. Only a family with a clip oracle (`reference_clip_rows`) samples any."""
        if self.parity_sample_rate <= 0 or not hasattr(self.cpu.family, "reference_clip_rows"):
            return False
        return self._in_sample(hashlib.sha256(f"{record.source.id}\0clip {index}".encode()).hexdigest())

    def _in_sample(self, digest: str) -> bool:
        return self.parity_sample_rate > 0 and int(digest[:8], 16) < self.parity_sample_rate * 16 ** 8

    def checked_rows(self, record: PreparedRecord, index: int, image: DecodedImage, plan: ImagePlan, grid: tuple,
                     rows: torch.Tensor, all_finite: bool) -> torch.Tensor:
        """The image's rows once they pass every check: the backend's, or the CPU path's instead."""
        stats = record.preprocess

        def backend_rows() -> torch.Tensor:
            _check_image(index, plan, grid, rows)
            require(all_finite, "preprocess.feature_length", f"image {index}: pixel rows hold NaN or Inf (values "
                    "the backend never wrote)", expected="every value written and finite", observed="non-finite",
                    image_index=index)
            if self.sampled(image):
                stats.parity_checked.add(index)
                self._check_parity(index, image, plan, rows, stats)
            return rows

        def cpu_rows() -> torch.Tensor:
            redone, redone_grid = self.cpu.image_rows(image, plan)
            _check_image(index, plan, redone_grid, redone)
            return redone.to(rows.device)

        return self._guarded(record, f"image {index}", index, backend_rows, cpu_rows)

    def checked_clip_rows(self, record: PreparedRecord, index: int, clip, plan, rows: torch.Tensor,
                          all_finite: bool) -> torch.Tensor:
        """A clip's rows once they pass every check: the backend's, or the CPU path's (`clip_rows`) instead. Its
        events are kept by its index among the record's media (its images, then its clips), so an image's and a
        clip's never collide, and counted with the images' (a clip is one)."""
        stats, media_index = record.preprocess, len(record.images) + index

        def backend_rows() -> torch.Tensor:
            _check_clip(index, plan, rows, all_finite)
            if self.sampled_clip(record, index):
                stats.parity_checked.add(media_index)
                self._check_clip_parity(index, clip, plan, rows, stats, media_index)
            return rows

        def cpu_rows() -> torch.Tensor:
            redone = clip_rows(torch.as_tensor(clip.pixels), plan, self.cpu.family)
            _check_clip(index, plan, redone, True)
            return redone.to(rows.device)

        return self._guarded(record, f"clip {index}", media_index, backend_rows, cpu_rows)

    def _guarded(self, record: PreparedRecord, label: str, key: int, backend_rows: Callable[[], torch.Tensor],
                 cpu_rows: Callable[[], torch.Tensor]) -> torch.Tensor:
        """`backend_rows()` where every check passes; where one fails, with preprocess.fallback=cpu `cpu_rows()` (the
        CPU path, checked again), the failure kept on the record's stats under `key`; else the failure, the
        record's."""
        try:
            return backend_rows()
        except CheckFailed as failure:
            if not self.fallback:
                failure.record = record
                raise
            log.warning("%s %s: %s; redone on the CPU path", record.source.id, label, failure)
            record.preprocess.fallbacks[key] = failure.check
            try:
                return cpu_rows()
            except CheckFailed as cpu_failure:
                cpu_failure.record = record
                raise

    def _check_parity(self, index: int, image: DecodedImage, plan: ImagePlan, rows: torch.Tensor,
                      stats: PreprocessStats) -> None:
        """Within parity_max_levels uint8 levels of the HF processor; of the CPU path for RGBA images,
        which the HF processors do not composite."""
        if image.has_alpha:
            oracle, _ = self.cpu.image_rows(image, plan)
        else:
            oracle, _ = self.cpu.family.reference_preprocess([image.on_host()])
        levels = self.cpu.levels(rows.detach().float().cpu(), oracle.float(), plan)
        self._within_levels(levels, rows, oracle, stats, index, f"image {index}", image_index=index)

    def _check_clip_parity(self, index: int, clip, plan, rows: torch.Tensor, stats: PreprocessStats,
                           media_index: int) -> None:
        """Within parity_max_levels uint8 levels of the family's HF processor on the clip's frames."""
        oracle = self.cpu.family.reference_clip_rows(np.asarray(clip.pixels), plan).float()
        ours = rows.detach().float().cpu()
        levels = (float(((ours - oracle).abs() / self.cpu.row_scale.cpu()).max()) if ours.shape == oracle.shape
                  else None)
        self._within_levels(levels, ours, oracle, stats, media_index, f"clip {index}", video_index=index)

    def _within_levels(self, levels: float | None, ours: torch.Tensor, oracle: torch.Tensor, stats: PreprocessStats,
                       key: int, label: str, **where) -> None:
        """preprocess.parity where the backend's rows are off the oracle's shape (`levels` None) or over
        parity_max_levels from them, the failure kept on the record's stats under `key`."""
        if levels is None or levels > self.parity_max_levels:
            stats.parity_failed.add(key)
            observed = (f"shape {tuple(ours.shape)} vs {tuple(oracle.shape)}" if levels is None
                        else f"{levels:.2f} levels")
            raise CheckFailed("preprocess.parity", f"{label}: the backend's pixels differ from the reference "
                              f"processor's by {observed}", expected=f"<= {self.parity_max_levels} levels",
                              observed=observed, **where)


def merged_stats(parts: list[dict]) -> dict:
    """`PreprocessStats.counts()` of records (or of units, as their manifests keep them) added up."""
    fallbacks = sum((Counter(part.get("fallbacks", {})) for part in parts), Counter())
    return {"fallbacks": dict(fallbacks),
            "parity": {key: sum(part.get("parity", {}).get(key, 0) for part in parts)
                       for key in ("checked_images", "failed_images")}}


def preprocess_batch(records: list[PreparedRecord], preprocessor, guard: PreprocessGuard | None = None,
                     syncs: Syncs | None = None) -> PixelBatch:
    """Preprocess every image of the records and pack them, checking grids and row counts per image.

    That every value was written and is finite is checked per image too. With `syncs` it is read back at once (a
    counted wait), and an image that fails it is redone on the CPU path or quarantined like any other; without, it
    stays on the device in the batch (PixelBatch.finite), read back with the tower's outputs (encode.finish_batch),
    and a batch that fails it is redone on the checked path."""
    guard = guard or PreprocessGuard()
    rows, grids, clips_rows = preprocessor(records)
    clips = clips_of(records)
    clips_rows = backend_clip_rows(clips, clips_rows)
    images, plans = images_and_plans(records)
    # Which image lost its grid cannot be told from a short list: the device stage bisects such a batch.
    require(len(grids) == len(plans), "preprocess.grid_match", "the backend returned a grid count that differs "
            "from the batch's image count", expected=len(plans), observed=len(grids))
    require(len(rows) == len(plans), "preprocess.feature_length", "the backend returned pixels for a different "
            "number of images than the batch has", expected=len(plans), observed=len(rows))
    owners = [(record, index) for record in records for index in range(len(record.plans))]
    every = rows + clips_rows
    on_device = torch.stack([torch.isfinite(part).all() for part in every]) if every else None
    finite = syncs.read(on_device) if syncs is not None and every else [True] * len(every)
    rows = [guard.checked_rows(record, index, image, plan, grid, image_rows, all_finite)
            for (record, index), image, plan, grid, image_rows, all_finite
            in zip(owners, images, plans, grids, rows, finite)]
    clips_rows = [guard.checked_clip_rows(record, index, clip, plan, part, all_finite)
                  for (record, index, clip, plan), part, all_finite in zip(clips, clips_rows, finite[len(rows):])]
    pixel_values = torch.cat(in_record_order(records, rows, clips_rows) if clips_rows else rows)
    grid_thw = torch.tensor([plan.grid_thw for record in records for plan in record.media_plans], dtype=torch.int64)
    require(pixel_values.shape[0] == int(grid_thw.prod(-1).sum()), "preprocess.feature_length",
            "packed pixel rows do not match the batch's grids",
            expected=int(grid_thw.prod(-1).sum()), observed=pixel_values.shape[0])
    return PixelBatch(pixel_values=pixel_values, grid_thw=grid_thw, records=records,
                      finite=None if syncs is not None else on_device)


def _check_clip(index: int, plan, rows: torch.Tensor, all_finite: bool) -> None:
    """As many rows as the clip's plan has patches, every value finite; a failure names the clip."""
    try:
        require(rows.shape[0] == plan.num_patches, "preprocess.feature_length", f"clip {index}: {rows.shape[0]} "
                f"pixel rows for {plan.num_patches} planned patches", expected=plan.num_patches,
                observed=rows.shape[0])
        require(all_finite, "preprocess.feature_length", f"clip {index}: pixel rows hold NaN or Inf",
                expected="every value written and finite", observed="non-finite")
    except CheckFailed as failure:
        failure.video_index = index
        raise


def in_record_order(records: list[PreparedRecord], image_rows: list, clip_rows: list) -> list:
    """Per-image and per-clip rows (each in batch order) in the order the tower's outputs are split back: record by
    record, its images, then its clips (PreparedRecord.media)."""
    images, clips, ordered = iter(image_rows), iter(clip_rows), []
    for record in records:
        ordered += [next(images) for _ in record.images] + [next(clips) for _ in record.clips]
    return ordered


def _check_image(index: int, plan: ImagePlan, grid: tuple, image_rows: torch.Tensor) -> None:
    require(tuple(grid) == tuple(plan.grid_thw), "preprocess.grid_match",
            f"image {index}: preprocessing produced grid {tuple(grid)}, the plan says {plan.grid_thw}",
            expected=plan.grid_thw, observed=tuple(grid), image_index=index)
    require(image_rows.shape[0] == plan.num_patches, "preprocess.feature_length",
            f"image {index}: {image_rows.shape[0]} pixel rows for {plan.num_patches} planned patches",
            expected=plan.num_patches, observed=image_rows.shape[0], image_index=index)
