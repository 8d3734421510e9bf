"""Devices: which one a job runs on, and the one copy from host to device that the hot paths share."""

from __future__ import annotations

import torch


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor on `device`: from the host on CUDA through pinned memory, queued on the current stream without
    waiting; a tensor already on a device is moved as it is."""
    if device.type != "cuda" or host.is_cuda:
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def on_cpu(device: str) -> bool:
    """model.device names the CPU, or `auto` finds no GPU."""
    return device == "cpu" or (device == "auto" and not torch.cuda.is_available())
