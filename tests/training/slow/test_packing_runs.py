"""Packing the records of a real run: restarted positions, masked labels, the batch on the device, and refusals."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from batchvlm.format.schema import IMAGE
from batchvlm.training import IGNORE_INDEX, PackingError, pack
from batchvlm.training.packing import check_packed

# runs of the job
pytestmark = pytest.mark.slow


def test_a_packed_batch_covers_its_length_with_restarted_positions_and_masked_labels(records):
    chosen = [r for r in records if r.id in ("astronaut", "text_only", "cat_and_coffee")]
    batch = pack(chosen, max_tokens=2048)
    lengths = [len(r.input_ids) for r in chosen]
    assert batch.cu_seqlens.tolist() == [0, lengths[0], lengths[0] + lengths[1], sum(lengths)]
    assert batch.position_ids.shape == (4, 1, sum(lengths)) and batch.max_seqlen == max(lengths)
    for index, (record, start) in enumerate(zip(chosen, batch.cu_seqlens.tolist())):
        segment = slice(start, start + len(record.input_ids))
        assert batch.position_ids[0, 0, segment].tolist() == list(range(len(record.input_ids)))
        assert torch.equal(batch.position_ids[1:, 0, segment], record.position_ids)
        assert (batch.document_ids[0, segment] == index).all()
        labels = batch.labels[0, segment]
        assert labels[0] == IGNORE_INDEX
        assert torch.equal(labels[1:] == IGNORE_INDEX, record.token_tags[1:] == IMAGE)
    assert torch.equal(batch.input_ids[0, batch.image_positions], torch.cat([
        r.input_ids[r.image_token_positions()] for r in chosen]))
    assert torch.equal(batch.image_embeds, torch.cat([r.image_embeds for r in chosen]))


def test_a_packed_batch_moves_every_tensor_to_the_device(records):
    batch = pack(records[:3], max_tokens=2048).to("meta")
    tensors = [v for v in vars(batch).values() if isinstance(v, torch.Tensor)] + list(batch.extras.values())
    assert len(tensors) >= 9 and all(t.device.type == "meta" for t in tensors)


def test_a_batch_that_does_not_add_up_is_refused(records):
    batch = pack(records[:3], max_tokens=2048)
    unrestarted = batch.position_ids.clone()
    unrestarted[0, 0] = torch.arange(batch.num_tokens)
    with pytest.raises(PackingError, match="restart"):
        check_packed(replace(batch, position_ids=unrestarted), 2048)
    with pytest.raises(PackingError, match="token_tags must cover"):
        check_packed(replace(batch, token_tags=batch.token_tags[:, 1:]), 2048)
    with pytest.raises(PackingError, match="cu_seqlens"):
        check_packed(replace(batch, cu_seqlens=batch.cu_seqlens[:-1]), 2048)
    with pytest.raises(PackingError, match="image_embeds rows"):
        check_packed(replace(batch, image_embeds=batch.image_embeds[1:]), 2048)
    with pytest.raises(PackingError, match="max_tokens"):
        pack(records[:3], max_tokens=batch.num_tokens - 1)


def test_labels_follow_a_records_loss_mask_and_a_plain_texts_tags(records):
    """A conversation's labels are its stored mask (-100 elsewhere and on its first token); a plain text beside it in
    the same pack keeps today's rule (every token but image tokens)."""
    text, other = [r for r in records if r.id in ("astronaut", "coffee")]
    mask = torch.zeros(len(other.input_ids), dtype=torch.int8)
    mask[-5:] = 1
    batch = pack([text, replace(other, loss_mask=mask)], max_tokens=4096)
    start = len(text.input_ids)
    labels = batch.labels[0]
    assert torch.equal(labels[1:start] == IGNORE_INDEX, text.token_tags[1:] == IMAGE)
    assert torch.equal(labels[start:] != IGNORE_INDEX, mask.bool())
    assert torch.equal(labels[-5:], other.input_ids[-5:])
