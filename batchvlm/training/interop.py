"""The output in other libraries' conventions: transformers' token types, `datasets` rows (the engines' inputs are
serving.py's).

token_tags -> mm_token_type_ids: batchvlm tags 0 text, 1 image token, 2 frame token (the
vision_start / media_begin ... tokens around a span), 3 video token; transformers' `mm_token_type_ids` are 0 text,
1 image, 2 video, and a frame token is text to it (`get_rope_index` gives it a text position). So
image tokens map to 1, video tokens to 2 and everything else to 0.

token_tags -> MiniMax-H3's `token_tags` (diffusers' `MiniMaxH3Transformer3DModel`, sglang's `minimax_h3` DiT): one
int64 tag per row of one packed 1-D sequence, 0 video, 1 text, 2 audio, and -1 on the rows that pad the sequence to a
multiple of 64 (the reference pads for FlashAttention and splits the tail off with `cu_seqlens = [0, used, S]`; its
AdaLN clamps -1 to 0, so a pad row must never be counted as a modality's row). Clip tokens map to 0 and text and frame
tokens to 1 (a frame token is a token of the text stream there too). H3 has no image type: an image is a conditioning
row only as a video latent, which a VLM's image-embedding position is not, so image tokens are refused unless the
caller says they stand for conditioning rows (then 0, as H3 tags its conditioning images). batchvlm writes no audio,
so 2 is never produced.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from batchvlm.format.hf_features import EMBED_ID_PREFIX, embedding_layouts
from batchvlm.format.schema import EXTRA_OUTPUTS, FRAME, IMAGE, TEXT, VIDEO
from batchvlm.rundir.dedup import duplicate_rows
from batchvlm.rundir.layout import DATA, RunLayout
from batchvlm.training.reader import RecordTensors, Runs, trusted_shards


def mm_token_type_ids(token_tags: torch.Tensor) -> torch.Tensor:
    """transformers' `mm_token_type_ids` (int64, same shape) for batchvlm `token_tags`."""
    return (token_tags == IMAGE).long() + 2 * (token_tags == VIDEO).long()


MINIMAX_H3_VIDEO, MINIMAX_H3_TEXT, MINIMAX_H3_PAD = 0, 1, -1
"""MiniMax-H3's per-row modality tags (its AdaLN keeps one modulation per timestep and modality; 2, audio, batchvlm
never writes)."""
MINIMAX_H3_ALIGNMENT = 64
"""MiniMax-H3's packed sequence length is padded up to a multiple of this (FlashAttention's tile)."""


def minimax_h3_token_types(token_tags: torch.Tensor, images_as_video: bool = False,
                           alignment: int = MINIMAX_H3_ALIGNMENT) -> torch.Tensor:
    """MiniMax-H3's `token_tags` (int64, `(S,)`, S the first multiple of `alignment` >= the tokens) for batchvlm
    `token_tags` of one record or of one packed batch (`PackedBatch.token_tags`, `[1, L]`: H3 packs one sequence and
    its batch axis only replicates it). Every token gets its modality, the padded tail -1. Image tokens are refused
    (H3 has no image type) unless `images_as_video`, which tags them as video rows, as H3 tags its conditioning
    images; any other value is refused too, naming it."""
    if token_tags.dim() == 2 and token_tags.shape[0] == 1:
        token_tags = token_tags[0]
    if token_tags.dim() != 1:
        raise ValueError(f"MiniMax-H3 tags one packed sequence: token_tags must be (L,) or (1, L), "
                         f"got {list(token_tags.shape)}")
    if alignment < 1:
        raise ValueError(f"alignment must be a positive row count, got {alignment}")
    unknown = token_tags[~torch.isin(token_tags, torch.tensor((TEXT, IMAGE, FRAME, VIDEO), dtype=token_tags.dtype))]
    if len(unknown):
        raise ValueError(f"token_tags hold values batchvlm never writes: {sorted(set(unknown.tolist()))}")
    images = int((token_tags == IMAGE).sum())
    if images and not images_as_video:
        raise ValueError(f"MiniMax-H3 has no image type (0 video, 1 text, 2 audio): {images} image token(s) in "
                         "token_tags; pass images_as_video=True if they stand for H3's conditioning rows (tagged video)")
    types = torch.full((-(-len(token_tags) // alignment) * alignment,), MINIMAX_H3_PAD, dtype=torch.int64)
    video = (token_tags == VIDEO) | (token_tags == IMAGE)  # images are here only under images_as_video
    types[:len(token_tags)] = torch.where(video, MINIMAX_H3_VIDEO, MINIMAX_H3_TEXT)
    return types


def load_run_dataset(runs: Runs, allow_unfinished: bool = False, checksums: bool = False, **kwargs):
    """`datasets.load_dataset("parquet", split="train")` over the run's committed shards only (never a glob of
    data/, which may hold the files of an attempt that did not commit), each checked against its manifest, without
    the later occurrences of an id: the records `read_run` and the loader give. A run and its requeue runs
    (reader.Runs) are one dataset, each run's shards loaded and left out of as its own. `kwargs` go to
    `load_dataset`."""
    import datasets

    shards = trusted_shards(runs, allow_unfinished, checksums)
    if not shards:
        raise ValueError(f"{runs} has no committed shards")
    parts = []
    for run in dict.fromkeys(shard.run for shard in shards):
        mine = [shard for shard in shards if shard.run == run]
        dataset = datasets.load_dataset("parquet", data_files=[str(shard.path) for shard in mine], split="train",
                                        **kwargs)
        parts.append(_without_later_occurrences(dataset, run) if any(shard.skipped for shard in mine) else dataset)
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def _without_later_occurrences(dataset, layout: RunLayout):
    """Rows are told apart by their input and row; the duplicate pass lists the later occurrences by both."""
    later = {(duplicate["source"], duplicate["row"]) for duplicate in duplicate_rows(layout)
             if duplicate["kind"] == DATA}
    return dataset.filter(lambda sources, rows: [(s, r) not in later for s, r in zip(sources, rows)], batched=True,
                          input_columns=["source", "row"])


class DatasetRows:
    """Rows of a `datasets` dataset of batchvlm shards, as the RecordTensors `batchvlm.training.reader` gives for them.

    The embedding columns are bytes to `datasets`; their dtype and hidden size come from the dataset's own
    features, where the job wrote them (`batchvlm.format.hf_features`). So any dataset descended from the shards works
    without the run: after `load_dataset` (`load_run_dataset`), `map`, `select`, `save_to_disk`/`load_from_disk`,
    streaming. Features that lost them (`cast_column` of an embedding column, `IterableDataset.map` without
    `features=`) are refused, naming the column.
    """

    def __init__(self, features: Mapping | None):
        self.layouts = embedding_layouts(features)
        self._layout("image_embeds")  # refused here, not at the first row

    @classmethod
    def from_dataset(cls, dataset) -> DatasetRows:
        return cls(dataset.features)

    def _layout(self, name: str) -> tuple[torch.dtype, int]:
        if name not in self.layouts:
            raise ValueError(f"column {name!r}: this dataset's feature of it carries no batchvlm dtype or hidden size "
                             f"(a Value id '{EMBED_ID_PREFIX}<dtype>:<hidden>', which the job writes into every shard; "
                             "cast_column on the column, IterableDataset.map without features=, or shards written "
                             "before batchvlm wrote it and loaded other than by load_run_dataset lose it)")
        return self.layouts[name]

    def _embeddings(self, blob: bytes, name: str) -> torch.Tensor:
        dtype, hidden = self._layout(name)
        if not blob:
            return torch.zeros((0, hidden), dtype=dtype)
        return torch.frombuffer(bytearray(blob), dtype=dtype).view(-1, hidden)

    def tensors(self, row: dict) -> RecordTensors:
        """One `datasets` row (a dict of Python values) as the tensors `batchvlm.training.reader` gives for it."""
        video_embeds = row.get("video_embeds")
        return RecordTensors(
            id=row["id"], input_ids=_tensor(row["input_ids"], torch.int64),
            image_embeds=self._embeddings(row["image_embeds"], "image_embeds"),
            grid_thw=_tensor(row["grid_thw"], torch.int64, (-1, 3)), image_spans=_spans(row["image_spans"]),
            token_tags=_tensor(row["token_tags"], torch.int8),
            extras={name: self._embeddings(row[name], name) for name in EXTRA_OUTPUTS if row.get(name) is not None},
            position_ids=_tensor(row.get("position_ids"), torch.int64), rope_delta=row.get("rope_delta"),
            loss_mask=_tensor(row.get("loss_mask"), torch.int8),
            # a clip's rows are as wide as the images': image_embeds' layout
            video_embeds=None if video_embeds is None else self._embeddings(video_embeds, "image_embeds"),
            video_spans=_spans(row.get("video_spans")),
            video_grid_thw=_tensor(row.get("video_grid_thw"), torch.int64, (-1, 3)),
            second_per_grid_ts=_tensor(row.get("second_per_grid_ts"), torch.float64),
        )


def _tensor(values: list | None, dtype: torch.dtype, shape: tuple[int, ...] | None = None) -> torch.Tensor | None:
    """A column's value of a row as a tensor (`shape` where an empty list must keep its width); a null as None."""
    if values is None:
        return None
    tensor = torch.tensor(values, dtype=dtype)
    return tensor.reshape(shape) if shape is not None else tensor


def _spans(spans: list[dict] | None) -> torch.Tensor | None:
    """A spans column's value ({start, length} structs) as [spans, 2]; a null as None."""
    return None if spans is None else _tensor([(s["start"], s["length"]) for s in spans], torch.int64, (-1, 2))
