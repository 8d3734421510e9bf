"""Devices: the one copy from host to device that the job's hot paths share."""

from __future__ import annotations

import torch


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor on `device`: from the host on CUDA through pinned memory, queued on the current stream without
    waiting; a tensor already on a device is moved as it is."""
    if device.type != "cuda" or host.is_cuda:
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
