"""The overlap's stream parts: no-ops on the CPU, and what the compute stream is handed on CUDA."""

from __future__ import annotations

from contextlib import nullcontext

import numpy as np
import pytest
import torch

from batchvlm.executor.device import Staged, made_on_the_side
from batchvlm.devices import to_device
from batchvlm.executor.overlap import Streams
from batchvlm.records import DecodedImage, PixelBatch, PreparedRecord, SourceRecord


def test_on_the_cpu_the_streams_are_no_ops_and_copies_are_plain():
    streams = Streams(torch.device("cpu"))
    assert isinstance(streams.staging(), nullcontext) and streams.staged() is None
    pixels = torch.arange(12, dtype=torch.uint8).reshape(2, 2, 3)
    streams.hand_over(None, [pixels])  # nothing to wait for, nothing recorded
    assert torch.equal(to_device(pixels, torch.device("cpu")), pixels)


def test_the_compute_stream_is_handed_the_packed_pixels_their_flags_and_the_pixels_decoded_on_the_device():
    """A batch redone on the checked path packs its device-decoded pixels again on the compute stream: they must
    be handed over with the packed pixels, while pixels that came from the host are not the side stream's."""
    on_device, on_host = torch.zeros(2, 2, 3, dtype=torch.uint8), np.zeros((2, 2, 3), np.uint8)
    images = [DecodedImage(on_device, "JPEG", "a" * 64), DecodedImage(on_host, "PNG", "b" * 64)]
    record = PreparedRecord(SourceRecord("r", "u", "s", 0, "", []), images, [], None)
    packed = PixelBatch(pixel_values=torch.zeros(4, 3), grid_thw=torch.zeros(1, 3), records=[record],
                        finite=torch.ones(2, dtype=torch.bool))
    assert [t is on_device for t in made_on_the_side(Staged([record], None))] == [True]
    handed = made_on_the_side(Staged([record], packed))
    assert [id(t) for t in handed] == [id(on_device), id(packed.pixel_values), id(packed.finite)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (bash jobs/gpu_check.sh)")
def test_on_cuda_what_the_side_stream_made_is_read_whole_on_the_compute_stream():
    device = torch.device("cuda")
    streams = Streams(device)
    host = torch.arange(1 << 22, dtype=torch.float32)
    with streams.staging():
        made = to_device(host, device).mul_(2)  # a pinned, asynchronous copy, then work, all on the side stream
        ready = streams.staged()
    streams.hand_over(ready, [made])
    assert torch.equal(made.mul(0.5).cpu(), host)
