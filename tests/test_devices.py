"""Devices: which one the job runs on, the copies between host and device, the seam that counts syncs, and which
errors are the device's own."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batchvlm.devices import Syncs, gather_to, images_on, is_device_fault, launching_on, on_cpu, to_device, to_host

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (bash jobs/gpu_check.sh)")


def test_the_cpu_is_named_or_found_when_no_gpu_is():
    assert on_cpu("cpu")
    assert on_cpu("auto") == (not torch.cuda.is_available())
    assert not on_cpu("cuda:1")


def test_a_copy_to_the_cpu_is_a_plain_copy():
    host = torch.arange(6, dtype=torch.uint8)
    moved = to_device(host, torch.device("cpu"))
    assert moved.device.type == "cpu" and torch.equal(moved, host)


def test_parts_are_gathered_one_after_another_into_the_buffer():
    parts = [torch.arange(6, dtype=torch.uint8).reshape(2, 3), torch.full((4,), 9, dtype=torch.uint8)]
    out = torch.empty(10, dtype=torch.uint8)
    gather_to(parts, out)
    assert out.tolist() == [0, 1, 2, 3, 4, 5, 9, 9, 9, 9]


def test_parts_already_on_the_device_are_gathered_there_beside_those_from_the_host():
    """The branches of a CUDA job's staging, on the meta device: a batch whose every part is on the device (every JPEG
    decoded by nvJPEG) has no host part to stage; a mixed one stages only its host parts."""
    meta = torch.device("meta")
    on_device = [torch.empty(6, dtype=torch.uint8, device=meta), torch.empty((2, 2), dtype=torch.uint8, device=meta)]
    out = torch.empty(10, dtype=torch.uint8, device=meta)
    gather_to(on_device, out)
    gather_to([on_device[0], torch.full((4,), 9, dtype=torch.uint8)], out)
    gather_to([], torch.empty(0, dtype=torch.uint8, device=meta))


@CUDA
def test_on_cuda_a_batch_whose_parts_are_all_on_the_device_is_gathered():
    device = torch.device("cuda")
    out = torch.empty(10, dtype=torch.uint8, device=device)
    gather_to([torch.arange(6, dtype=torch.uint8, device=device), torch.full((4,), 9, dtype=torch.uint8, device=device)],
              out)
    assert out.tolist() == [0, 1, 2, 3, 4, 5, 9, 9, 9, 9]


def test_images_keep_their_shapes_on_the_device():
    images = images_on([np.zeros((2, 3, 3), np.uint8), np.ones((1, 4, 4), np.uint8)], torch.device("cpu"))
    assert [tuple(image.shape) for image in images] == [(2, 3, 3), (1, 4, 4)] and int(images[1].sum()) == 16


def test_kernels_are_launched_under_the_configured_device():
    """Triton launches on the current CUDA device: the context names the job's, not device 0 (built without a GPU)."""
    assert launching_on(torch.device("cuda:1")).idx == 1
    with launching_on(torch.device("cpu")):
        pass


def test_each_wait_and_read_through_the_seam_is_counted():
    syncs = Syncs()
    host, ready = to_host([torch.arange(3)])
    syncs.wait(ready)
    assert syncs.read(torch.tensor([True, False])) == [True, False]
    syncs.batches = 2
    with syncs.counting(torch.device("cpu")):
        torch.arange(3).tolist()  # no device: nothing implicit to count
    assert (syncs.waits, syncs.implicit, syncs.per_batch) == (2, 0, 1.0)


@pytest.mark.parametrize("message,fault", [
    ("CUDA error: an illegal memory access was encountered", True), ("CUDA error: device-side assert triggered", True),
    ("cuDNN error: CUDNN_STATUS_INTERNAL_ERROR", True), ("CUDA out of memory. Tried to allocate 2.00 GiB", False),
    ("Input type (float) and bias type (c10::BFloat16) should be the same", False)])
def test_cuda_errors_are_the_devices_own(message, fault):
    assert is_device_fault(RuntimeError(message)) == fault


@CUDA
def test_on_cuda_an_implicit_sync_is_counted_and_a_wait_through_the_seam_is_not_counted_twice():
    device = torch.device("cuda")
    syncs = Syncs()
    with syncs.counting(device):
        torch.ones(4, device=device).sum().item()  # implicit
        syncs.read(torch.ones(4, device=device))  # on purpose, through the seam: counted once, as a wait
    assert (syncs.implicit, syncs.waits) == (1, 1)


@CUDA
def test_on_cuda_the_pinned_staging_block_is_reused_batch_after_batch():
    """No new pinned allocation (cudaHostAlloc) after the first batch: the caching host allocator hands the block
    back once its copy has run."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None or "num_host_alloc" not in stats():
        pytest.skip("this torch counts no pinned allocations")
    device = torch.device("cuda")
    out = torch.empty(1 << 20, dtype=torch.uint8, device=device)
    allocated = []
    for batch in range(5):
        gather_to([torch.full((1 << 20,), batch, dtype=torch.uint8)], out)
        torch.cuda.current_stream(device).synchronize()
        allocated.append(stats()["num_host_alloc"])
    assert len(set(allocated)) == 1 and int(out[-1]) == 4
