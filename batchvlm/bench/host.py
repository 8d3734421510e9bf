"""The host ceiling: the job with its device work taken out, against what its workers can decode.

A zero-cost device stage keeps every host-side step of the GPU path and drops the device's arithmetic:
- preprocessing gathers the batch's decoded pixels into one host block (what the pinned staging copy costs the host
  on a GPU) and hands back one value per patch row, so that every per-image check still runs on the right counts;
- the tower builds its host-side inputs (positions, interpolation taps, boundaries: host work on a GPU too) and
  returns zeros of the shape the plans expect.

What remains is the host's part of the job: the workers' decode, plan and layout, the crossing of records and pixels
to the main process, batching, staging, the read-back and checks, rows and the sink. Its images/s over the decode
stage's (one process, the safe path, as a worker runs it) times the workers is 1.0 where the host keeps up with its
decoders, and falls when anything between the workers and the device costs time: the ceiling a real tower's job can
reach on that machine, measured on a CPU.
"""

from __future__ import annotations

import dataclasses

import torch

from batchvlm.devices import host_block
from batchvlm.pipeline.preprocess import clips_of, images_and_plans


class ZeroCostPreprocessor:
    """Gathers the batch's pixels into one host block and returns one zero per patch row, with the planned grids (and
    a clip's rows as its plan's)."""

    def __call__(self, records) -> tuple[list[torch.Tensor], list[tuple], list[torch.Tensor]]:
        images, plans = images_and_plans(records)
        host_block([torch.as_tensor(image.pixels) for image in images])
        clips = [torch.zeros(plan.num_patches, 1) for *_, plan in clips_of(records)]
        return [torch.zeros(plan.num_patches, 1) for plan in plans], [plan.grid_thw for plan in plans], clips


class ZeroCostTower(torch.nn.Module):
    """A family's encoder with its tower's arithmetic taken out: its host-side inputs built, zeros returned."""

    def __init__(self, encoder: torch.nn.Module):
        super().__init__()
        self.encoder = encoder
        self.hidden_sizes = encoder.hidden_sizes
        self.hidden_size = encoder.hidden_size
        self.merge_area = getattr(encoder, "merge_area", 1)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> dict[str, list[torch.Tensor]]:
        self.encoder.inputs(pixel_values, grid_thw)
        sizes = (grid_thw.prod(-1) // self.merge_area).tolist()
        return {name: list(torch.zeros(sum(sizes), size, device=pixel_values.device).split(sizes))
                for name, size in self.hidden_sizes.items()}


def without_device_work(parts) -> None:
    """A built job (executor.job.Parts) whose device stage costs nothing but its host-side steps."""
    stage = parts.stage
    stage.preprocessor = ZeroCostPreprocessor()
    stage.encoder = ZeroCostTower(stage.encoder)
    stage.guard = dataclasses.replace(stage.guard, parity_sample_rate=0.0)  # no HF processor run on zero rows
