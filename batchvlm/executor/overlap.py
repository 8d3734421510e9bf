"""Overlap on the device: batch k+1 is copied and preprocessed on a side stream while batch k encodes on the
compute stream (the main thread's current stream), and each batch's results cross to the host on a read-back stream,
so that the tower of the next batch starts while they do. On the CPU there are no streams: every part below is a
no-op and the same code runs in program order, which is how the tests exercise it.

Lifetimes across the streams:
- host -> device copies come from pinned memory, asynchronously (`devices.gather_to`, `to_device`). The pinned
  buffer is PyTorch's caching host allocator's: it records the copy's stream and does not hand the block out again
  before the copy has run, so the host tensor may be dropped as soon as the copy is queued.
- a tensor made on the side stream and read on the compute stream (the packed pixels; the pixels decoded on the
  device, which a batch redone on the checked path packs again there) belongs to the side stream's pool: freed
  once the job drops it, the caching allocator could give its block to the side stream's next batch while the
  tower still reads it. `hand_over` makes the compute stream wait for the side stream's event and
  `record_stream`s the tensor on the compute stream, so the block is reused only after the compute stream's work
  queued so far (the tower on this batch) is done.
- device -> host copies run on the read-back stream, after the compute stream's work on the batch
  (`devices.to_host`, which record_streams what they read there); the host waits for them through an event.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch


class Streams:
    """The side stream that stages batches, the read-back stream, and the hand-over of what the side stream made to
    the compute stream. Without `overlap` (or on the CPU) there are none: everything runs on the current stream."""

    def __init__(self, device: torch.device, overlap: bool = True):
        on_cuda = overlap and device.type == "cuda"
        self.side = torch.cuda.Stream(device) if on_cuda else None
        self.back = torch.cuda.Stream(device) if on_cuda else None

    def staging(self):
        """The context to queue a batch's copies and preprocessing in: the side stream (CUDA), or nothing."""
        return torch.cuda.stream(self.side) if self.side is not None else nullcontext()

    def staged(self) -> torch.cuda.Event | None:
        """An event after everything queued on the side stream so far (None without one)."""
        return self.side.record_event() if self.side is not None else None

    def hand_over(self, ready: torch.cuda.Event | None, tensors: list[torch.Tensor]) -> None:
        """Let the compute stream use `tensors`, made on the side stream up to `ready` (see the module's notes)."""
        if ready is None:
            return
        compute = torch.cuda.current_stream(self.side.device)
        compute.wait_event(ready)
        for tensor in tensors:
            if tensor.is_cuda:
                tensor.record_stream(compute)
