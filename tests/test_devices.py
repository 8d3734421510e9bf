"""Devices: which one the job runs on, and host tensors copied to it."""

from __future__ import annotations

import torch

from batchvlm.devices import on_cpu, to_device


def test_the_cpu_is_named_or_found_when_no_gpu_is():
    assert on_cpu("cpu")
    assert on_cpu("auto") == (not torch.cuda.is_available())
    assert not on_cpu("cuda:1")


def test_a_copy_to_the_cpu_is_a_plain_copy():
    host = torch.arange(6, dtype=torch.uint8)
    moved = to_device(host, torch.device("cpu"))
    assert moved.device.type == "cpu" and torch.equal(moved, host)
