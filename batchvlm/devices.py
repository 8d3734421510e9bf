"""Devices: which one a job runs on, the copies between host and device that the hot paths share, the seam that
counts the hot loop's host-device syncs, and which errors are the device's own."""

from __future__ import annotations

import warnings
from contextlib import contextmanager, nullcontext

import torch

DEVICE_FAULTS = ("CUDA error", "CUBLAS_STATUS_", "CUDNN_STATUS_", "cuDNN error", "device-side assert",
                 "illegal memory access", "NCCL error")
"""Words of the errors CUDA reports for a fault of the device or of the job's own code on it: sticky (every later
call fails too) or systematic, never the fault of one record. Out of memory is not among them."""
SYNC_WARNING = "called a synchronizing CUDA operation"
"""What torch.cuda.set_sync_debug_mode('warn') says of each implicit sync."""


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor on `device`: from the host on CUDA through pinned memory, queued on the current stream without
    waiting; a tensor already on a device is moved as it is."""
    if device.type != "cuda" or host.is_cuda:
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def gather_to(parts: list[torch.Tensor], out: torch.Tensor) -> None:
    """`parts` (each flattened; on the host, or already on `out`'s device) written one after another into `out`.

    Parts already on `out`'s device (all of them in a CPU job; the JPEGs nvJPEG decoded, on CUDA) are copied there, and
    so are page-locked host parts (a worker's ring, executor.transport), asynchronously. The other host parts are
    gathered straight into one host block (`host_block`: pinned where `out` is on CUDA), the only host copy, and
    cross in one asynchronous copy. The pinned block is PyTorch's caching host allocator's: it records the copy's
    stream and hands the same block out again once the copy has run, so batch after batch reuses one staging buffer
    without a wait."""
    flat = [part.reshape(-1) for part in parts]
    staged = [part.device != out.device and not (out.is_cuda and part.is_pinned()) for part in flat]
    if flat and all(staged):
        out.copy_(host_block(flat, pinned=out.is_cuda), non_blocking=True)
        return
    host = [part for part, stage in zip(flat, staged) if stage]
    moved = iter(host_block(host, pinned=out.is_cuda).to(out.device, non_blocking=True).split(
        [part.numel() for part in host]) if host else ())
    pieces = [next(moved) if stage else part for part, stage in zip(flat, staged)]
    if all(piece.device == out.device for piece in pieces):
        if pieces:
            torch.cat(pieces, out=out)
        return
    for piece, place in zip(pieces, out.split([piece.numel() for piece in pieces])):
        place.copy_(piece, non_blocking=True)


def host_block(parts: list[torch.Tensor], pinned: bool = False) -> torch.Tensor:
    """Host tensors (flattened) one after another in one new host block, page-locked where `pinned`."""
    block = torch.empty(sum(part.numel() for part in parts), dtype=parts[0].dtype if parts else torch.uint8,
                        pin_memory=pinned)
    if parts:
        torch.cat([part.reshape(-1) for part in parts], out=block)
    return block


def images_on(pixels: list, device: torch.device) -> list[torch.Tensor]:
    """Images (host arrays or tensors, or tensors already on `device`) as tensors on `device`; on CUDA the host ones
    cross together, one batch in one copy (`gather_to`)."""
    tensors = [torch.as_tensor(image) for image in pixels]
    if device.type != "cuda":
        return tensors
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=torch.uint8, device=device)
    gather_to(tensors, flat)
    return [part.view(t.shape) for part, t in zip(flat.split([t.numel() for t in tensors]), tensors)]


def to_host(tensors: list[torch.Tensor], stream=None) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
    """Device tensors on their way to the host, and the event after which they are there (None: already there).

    On CUDA each crosses into pinned memory on `stream` (the current one if None), which first waits for the work
    queued so far on the current stream; the tensors are kept from reuse until the copies have run, so the current
    stream goes on at once. On the CPU they are the tensors themselves."""
    if not tensors or not tensors[0].is_cuda:
        return list(tensors), None
    current = torch.cuda.current_stream(tensors[0].device)
    stream = stream or current
    if stream != current:
        stream.wait_stream(current)
    host = []
    with torch.cuda.stream(stream):
        for tensor in tensors:
            if stream != current:
                tensor.record_stream(stream)
            host.append(torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True))
            host[-1].copy_(tensor, non_blocking=True)
    return host, stream.record_event()


def launching_on(device: torch.device):
    """The context that makes `device` the current CUDA device, so that kernels launched without naming one (Triton's)
    run there and not on device 0; nothing on the CPU."""
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()


def on_cpu(device: str) -> bool:
    """model.device names the CPU, or `auto` finds no GPU."""
    return device == "cpu" or (device == "auto" and not torch.cuda.is_available())


def is_device_fault(error: BaseException) -> bool:
    """A CUDA error (an illegal address, a device-side assert, a library's failure status): never a record's fault."""
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return False
    accelerator = getattr(torch, "AcceleratorError", None)  # torch >= 2.9 raises CUDA errors as this
    return (accelerator is not None and isinstance(error, accelerator)) or any(
        word in str(error) for word in DEVICE_FAULTS)


class Syncs:
    """The seam that counts the hot loop's host-device syncs.

    Every wait the loop makes on purpose goes through `wait` (an event: the host waits for the copies it queued) or
    `read`, and is counted there, on any device. Inside `counting()` on CUDA, torch.cuda.set_sync_debug_mode turns
    every other sync (a .tolist() or .item() of a device tensor, a blocking copy, a stream synchronize) into a
    warning, counted as `implicit`: the figure that shows whether the loop syncs only where it means to."""

    def __init__(self):
        self.batches = 0
        self.waits = 0
        self.implicit = 0

    def wait(self, event: torch.cuda.Event | None) -> None:
        self.waits += 1
        if event is not None:
            event.synchronize()

    def read(self, tensor: torch.Tensor) -> list:
        """A small device tensor's values on the host: one counted wait."""
        (host,), ready = to_host([tensor])
        self.wait(ready)
        return host.tolist()

    @property
    def per_batch(self) -> float:
        return (self.waits + self.implicit) / max(self.batches, 1)

    @contextmanager
    def counting(self, device: torch.device):
        """Count the implicit syncs on `device` too (CUDA); on the CPU there are none to count."""
        if device.type != "cuda":
            yield self
            return
        previous = torch.cuda.get_sync_debug_mode()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield self
            finally:
                torch.cuda.set_sync_debug_mode(previous)
        self.implicit += sum(SYNC_WARNING in str(warning.message) for warning in caught)
