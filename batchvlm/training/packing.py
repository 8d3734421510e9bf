"""Records packed into one varlen sequence, with the positions each model family needs, checked as built.

A packed sequence is only correct if every per-token tensor covers exactly the packed length and
every record's positions restart where its segment starts: transformers finds the documents of a
packed batch from the text position row alone (`find_packed_sequence_indices`: a new document
wherever a position does not follow its predecessor by 1), and flash-attention from `cu_seqlens`.
Concatenated positions that do not restart silently let every record attend to the ones before it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from batchvlm.training.reader import RecordArrays, RecordTensors, record_arrays, span_positions, tensor_of
from batchvlm.format.schema import IMAGE, VIDEO

IGNORE_INDEX = -100
"""The label transformers' cross-entropy skips."""


class PackingError(ValueError):
    """A packed batch whose parts do not add up; never handed to a trainer."""


@dataclass
class PackedBatch:
    ids: list[str]  # the records, in packed order
    input_ids: torch.Tensor  # [1, L] int64
    labels: torch.Tensor  # [1, L] int64: -100 on each record's first token, and on the tokens its loss_mask does not
    # train (a conversation), or on image tokens (a plain text)
    token_tags: torch.Tensor  # [1, L] int8: 0 text, 1 image token, 2 frame token
    document_ids: torch.Tensor  # [1, L] int64: index of the record each token belongs to
    position_ids: torch.Tensor  # [4, 1, L] (text row, then M-RoPE t, h, w) for Qwen, else [1, L]; restarted per record
    cu_seqlens: torch.Tensor  # [n_records + 1] int32
    max_seqlen: int
    image_embeds: torch.Tensor  # [n_image_tokens, hidden], all records' image tokens in sequence order
    image_positions: torch.Tensor  # [n_image_tokens] int64: where each row of image_embeds goes in the sequence
    grid_thw: torch.Tensor  # [n_images, 3]
    extras: dict[str, torch.Tensor]  # the records' other embedding columns, concatenated in order
    deepstack_embeds: list[torch.Tensor] | None  # Qwen3-VL: one [n_image_tokens, hidden] tensor per deepstack layer
    video_embeds: torch.Tensor | None = None  # [n_video_tokens, hidden], all records' clip tokens in sequence order
    video_positions: torch.Tensor | None = None  # [n_video_tokens] int64: where each row of video_embeds goes

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    def to(self, device: torch.device | str) -> PackedBatch:
        """Every tensor of the batch on `device`, cu_seqlens included (flash-attention reads it there)."""
        moved = {name: value.to(device) for name, value in vars(self).items() if isinstance(value, torch.Tensor)}
        layers = [layer.to(device) for layer in self.deepstack_embeds] if self.deepstack_embeds is not None else None
        return replace(self, **moved, extras={k: v.to(device) for k, v in self.extras.items()}, deepstack_embeds=layers)

    def flash_attn_kwargs(self) -> dict:
        """transformers' FlashAttentionKwargs, for flash_attention_2 without deriving them from positions."""
        cu = self.cu_seqlens.to(torch.int32)
        return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": self.max_seqlen,
                "max_length_k": self.max_seqlen}


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of `lengths` in bins of at most `capacity` tokens: longest first, each into the first bin it fits."""
    bins: list[list[int]] = []
    free: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        target = next((b for b, room in enumerate(free) if lengths[index] <= room), None)
        if target is None:
            bins.append([])
            free.append(capacity)
            target = len(bins) - 1
        bins[target].append(index)
        free[target] -= lengths[index]
    return bins


def text_positions(cu_seqlens: np.ndarray) -> np.ndarray:
    """0, 1, 2, ... restarting at every record boundary: the row transformers reads documents from."""
    return np.arange(int(cu_seqlens[-1]), dtype=np.int64) - np.repeat(cu_seqlens[:-1], np.diff(cu_seqlens))


def pack(records: list[RecordTensors], max_tokens: int) -> PackedBatch:
    """The records as one checked sequence of at most `max_tokens` tokens."""
    return pack_arrays([record_arrays(r) for r in records], max_tokens)


# A pack is built in numpy and becomes tensors once at the end: a torch op on arrays this small costs several
# times a numpy op in dispatch alone, and a trainer's loader packs every batch.
def pack_arrays(records: list[RecordArrays], max_tokens: int) -> PackedBatch:
    """`pack` of records in the form a shard's columns give them (the loader's)."""
    if not records:
        raise PackingError("nothing to pack")
    lengths = np.array([len(r.input_ids) for r in records], dtype=np.int64)
    cu_seqlens = np.concatenate([[0], np.cumsum(lengths)])
    input_ids = np.concatenate([r.input_ids for r in records]).astype(np.int64)
    token_tags = np.concatenate([r.token_tags for r in records])
    # A record without images may store no extra at all: it contributes no rows.
    embeds = {name: tensor_of(np.concatenate([r.embeds[name] for r in records if name in r.embeds]),
                              records[0].embed_dtype)
              for name in dict.fromkeys(name for r in records for name in r.embeds)}
    image_embeds = embeds.pop("image_embeds")
    video_embeds = embeds.pop("video_embeds", None)
    batch = PackedBatch(
        ids=[r.id for r in records], input_ids=torch.from_numpy(input_ids)[None],
        labels=torch.from_numpy(_labels(input_ids, token_tags, cu_seqlens, records))[None],
        token_tags=torch.from_numpy(token_tags)[None],
        document_ids=torch.from_numpy(np.repeat(np.arange(len(records)), lengths))[None],
        position_ids=_position_ids(records, cu_seqlens), cu_seqlens=torch.from_numpy(cu_seqlens.astype(np.int32)),
        max_seqlen=int(lengths.max()), image_embeds=image_embeds,
        image_positions=torch.from_numpy(_packed_positions([r.image_spans for r in records], cu_seqlens)),
        grid_thw=torch.from_numpy(np.concatenate([r.grid_thw for r in records]).astype(np.int64).reshape(-1, 3)),
        extras=embeds, deepstack_embeds=_deepstack_layers(embeds.get("deepstack_embeds"), image_embeds.shape[1]),
        video_embeds=video_embeds, video_positions=_video_positions(records, cu_seqlens))
    check_packed(batch, max_tokens)
    return batch


def _video_positions(records: list[RecordArrays], cu_seqlens: np.ndarray) -> torch.Tensor | None:
    """Where each clip token of the pack sits, in the order of video_embeds' rows (None: no record has a clip)."""
    if all(r.video_spans is None for r in records):
        return None
    spans = [(r.video_spans if r.video_spans is not None else np.zeros((0, 2), np.int64)) for r in records]
    return torch.from_numpy(_packed_positions(spans, cu_seqlens))


def _packed_positions(spans: list[np.ndarray], cu_seqlens: np.ndarray) -> np.ndarray:
    """Every token of each record's spans ([n, 2]: start, length in the record), at its place in the pack."""
    joined = np.concatenate(spans).astype(np.int64).reshape(-1, 2)
    starts = joined[:, 0] + np.repeat(cu_seqlens[:-1], [len(s) for s in spans])
    return span_positions(starts, joined[:, 1])


def _labels(input_ids: np.ndarray, token_tags: np.ndarray, cu_seqlens: np.ndarray,
            records: list[RecordArrays]) -> np.ndarray:
    """The targets: a conversation's trained tokens (its stored loss_mask), a plain text's every token but image
    tokens. A record's first token would otherwise be the target of the previous record's last token."""
    trained = token_tags != IMAGE
    if any(r.loss_mask is not None for r in records):
        trained = np.concatenate([r.loss_mask.astype(bool) if r.loss_mask is not None else r.token_tags != IMAGE
                                  for r in records])
    labels = np.where(trained, input_ids, IGNORE_INDEX)
    labels[cu_seqlens[:-1]] = IGNORE_INDEX
    return labels


def _position_ids(records: list[RecordArrays], cu_seqlens: np.ndarray) -> torch.Tensor:
    text = text_positions(cu_seqlens)
    if records[0].position_ids is None:
        return torch.from_numpy(text)[None]
    # Stored M-RoPE rows start at 0 in every record already; the text row on top is what tells
    # transformers where the records are (a [3, B, L] tensor gives it nothing to detect).
    mrope = np.concatenate([r.position_ids for r in records], axis=1)
    return torch.from_numpy(np.concatenate([text[None], mrope]).astype(np.int64, copy=False))[:, None]


def _deepstack_layers(stacked: torch.Tensor | None, hidden: int) -> list[torch.Tensor] | None:
    # Stored with the layers side by side along hidden, each as wide as image_embeds.
    return list(stacked.split(hidden, dim=1)) if stacked is not None else None


def check_packed(batch: PackedBatch, max_tokens: int) -> None:
    """The invariants of a packed sequence (prompts-and-checks.md C11, A5, A6); PackingError names the first broken one.

    Messages are only formatted for a broken batch: this runs on every batch a trainer takes."""
    length = batch.num_tokens
    cu = batch.cu_seqlens.numpy(force=True).astype(np.int64)
    if not 0 < length <= max_tokens:
        raise PackingError(f"packed length {length} is not within 1..max_tokens={max_tokens}")
    for name in ("labels", "token_tags", "document_ids"):
        if getattr(batch, name).shape != (1, length):
            raise PackingError(f"{name} must cover the packed sequence [1, {length}], "
                               f"got {list(getattr(batch, name).shape)}")
    if batch.position_ids.shape[-1] != length:
        raise PackingError(f"position_ids must cover the packed sequence ({length}), got {list(batch.position_ids.shape)}")
    if not (len(cu) == len(batch.ids) + 1 and cu[0] == 0 and (np.diff(cu) > 0).all() and cu[-1] == length):
        raise PackingError(f"cu_seqlens {cu.tolist()} must start at 0, increase and end at the packed length {length}")
    if batch.max_seqlen != np.diff(cu).max():
        raise PackingError(f"max_seqlen {batch.max_seqlen} != longest record")
    if not np.array_equal(batch.position_ids.reshape(-1, length)[0].numpy(force=True), text_positions(cu)):
        raise PackingError("the text position row must restart at 0 at every cu_seqlens boundary and count up by 1")
    image_tokens = batch.token_tags[0].numpy(force=True) == IMAGE
    positions = batch.image_positions.numpy(force=True)
    if not len(positions) == len(batch.image_embeds) == image_tokens.sum():
        raise PackingError(f"{len(batch.image_embeds)} image_embeds rows, {len(positions)} positions and "
                           f"{image_tokens.sum()} image tokens must be equal")
    if not image_tokens[positions].all():
        raise PackingError("an image position is not on an image token")
    if not (batch.labels[0].numpy(force=True)[image_tokens] == IGNORE_INDEX).all():
        raise PackingError("an image token has a label")
    video_tokens = batch.token_tags[0].numpy(force=True) == VIDEO
    rows = 0 if batch.video_embeds is None else len(batch.video_embeds)
    at = np.zeros(0, np.int64) if batch.video_positions is None else batch.video_positions.numpy(force=True)
    if not (rows == len(at) == video_tokens.sum() and video_tokens[at].all()):
        raise PackingError(f"{rows} video_embeds rows and {len(at)} positions for {video_tokens.sum()} video tokens: "
                           "each clip token needs its row (a reader that left the clips out?)")
    if not (batch.labels[0].numpy(force=True)[video_tokens] == IGNORE_INDEX).all():
        raise PackingError("a video token has a label")
