"""The encode stage's per-batch work: non-finite values counted per image in one pass, one copy to the host."""

from __future__ import annotations

import torch

from batchvlm.pipeline.encode import non_finite_counts, to_host

NAN, INF = float("nan"), float("inf")


def test_non_finite_values_are_counted_per_output_and_image():
    outputs = {"image_embeds": [torch.zeros(2, 3), torch.tensor([[NAN, 1.0, INF], [0.0, 0.0, 0.0]])],
               "pooled_embeds": [torch.zeros(1, 3), torch.full((1, 3), NAN)]}
    assert non_finite_counts(outputs) == [("image_embeds", 0), ("image_embeds", 2), ("pooled_embeds", 0),
                                          ("pooled_embeds", 3)]


def test_outputs_come_to_the_host_in_the_stored_dtype_split_per_image():
    tensors = [torch.randn(3, 4), torch.randn(1, 4), torch.randn(2, 4)]
    host = to_host(tensors, torch.bfloat16)
    assert [t.shape for t in host] == [(3, 4), (1, 4), (2, 4)]
    assert all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in host)
    assert torch.equal(host[2], tensors[2].to(torch.bfloat16))
