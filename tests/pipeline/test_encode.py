"""The encode stage's per-batch work: non-finite values counted per image on the device, the outputs and those counts
read back in one copy and one wait, and a batch's halves (launch, finish) with the host free in between."""

from __future__ import annotations

import pytest
import torch

from batchvlm.devices import Syncs, to_host
from batchvlm.pipeline.encode import PixelsNotFinite, encode_batch, finish_batch, launch_batch, non_finite_counts
from batchvlm.pipeline.preprocess import TorchPreprocessor, preprocess_batch
from batchvlm.records import DecodedImage, PreparedRecord, SourceRecord, TokenLayout

NAN, INF = float("nan"), float("inf")


def test_non_finite_values_are_counted_per_image_of_an_output():
    joined = torch.cat([torch.zeros(2, 3), torch.tensor([[NAN, 1.0, INF], [0.0, 0.0, 0.0]]), torch.full((1, 3), NAN)])
    assert non_finite_counts(joined, [2, 2, 1]).tolist() == [0, 2, 3]


def test_outputs_come_to_the_host_as_they_are_on_the_cpu_with_nothing_to_wait_for():
    tensors = [torch.randn(3, 4).to(torch.bfloat16), torch.arange(3)]
    host, ready = to_host(tensors)
    assert ready is None and all(h is t for h, t in zip(host, tensors))


def batch_of(family, photos, preprocessor=None):
    from photos import photo_of_size

    records = []
    for index, (height, width) in enumerate(photos):
        image = DecodedImage(photo_of_size(height, width), "PNG", f"{index:064d}")
        source = SourceRecord(id=f"r{index}", unit_id="u", source="s", row=index, text="", images=[])
        records.append(PreparedRecord(source, [image], [family.plan(height, width)], TokenLayout([], [], [])))
    return preprocess_batch(records, preprocessor or TorchPreprocessor(family, torch.device("cpu"), "black"))


def test_a_batch_is_encoded_in_the_stored_dtype_with_one_wait(kimi_family):
    encoder = kimi_family.load_encoder(torch.device("cpu"), torch.float32)
    batch = batch_of(kimi_family, [(56, 84), (28, 28)])
    syncs = Syncs()
    encoded = encode_batch(encoder, batch, torch.bfloat16, syncs)
    assert [e.prepared.source.id for e in encoded] == ["r0", "r1"]
    assert [tuple(e.image_embeds[0].shape) for e in encoded] == [(6, encoder.hidden_size), (1, encoder.hidden_size)]
    assert all(e.image_embeds[0].dtype == torch.bfloat16 for e in encoded)
    assert (syncs.waits, syncs.implicit) == (1, 0)


def test_pixels_left_unwritten_fail_the_batch_at_its_one_read_back(kimi_family):
    """Preprocessing's check that every value was written rides on the batch (PixelBatch.finite) and is read with
    the tower's outputs: the batch is refused there, for the checked path to find the image."""
    encoder = kimi_family.load_encoder(torch.device("cpu"), torch.float32)
    batch = batch_of(kimi_family, [(56, 84), (28, 28)])
    assert batch.finite is not None and batch.finite.tolist() == [True, True]
    batch.finite[1] = False
    launched = launch_batch(encoder, batch, torch.bfloat16)
    with pytest.raises(PixelsNotFinite, match="1 images"):
        finish_batch(launched, Syncs())
