"""Typed records passed between stages. Stages exchange these, never dicts.

The job's stream (executor.steps) carries, in order: UnitStart, each record of the unit prepared (PreparedRecord) or
already quarantined (QuarantinedRecord), UnitEnd; the main process's steps turn prepared records into packed batches,
batches into Outcomes (encoded or quarantined records), and outcomes into Rows for the unit's shards."""

from __future__ import annotations

import enum
import functools
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # records carry tensors, but `status` and `verify` read a run's metadata without importing torch
    import torch


@dataclass(frozen=True)
class InputFile:
    """One input as the plan records it."""

    name: str  # stable, human-readable, unique within the run
    location: str  # what a user would open: a path or URL
    size: int | None = None  # bytes, where a listing tells it
    identity: dict = field(default_factory=dict, hash=False)
    """What tells this input from another of the same name: modification time, ETag or version where the file system
    keeps one; a `datasets` dataset's fingerprint and rows. A resume over an input whose identity changed is refused."""


@dataclass(frozen=True)
class WorkUnit:
    """A contiguous row range of one input (a Parquet file's row groups, a tar shard, a dataset shard):
    the unit of claiming, commit and resume. Planned from metadata alone, so `stop` is None where the
    input's row count is only known once it is read (tar shards, streamed datasets)."""

    unit_id: str
    source: str  # the input's name in the plan
    start: int
    stop: int | None
    nbytes: int = 0  # encoded input bytes, as the metadata tells them (the order units are claimed in)

    @property
    def num_rows(self) -> int | None:
        return None if self.stop is None else self.stop - self.start


@dataclass
class ImageRef:
    """An image as the dataset holds it: raw bytes, or a path (local, or an fsspec URL) to read them from."""

    data: bytes | None = None
    path: str | None = None
    storage_options: dict | None = None  # fsspec options for a URL path (the dataset's own)
    root: str | None = None  # the folder a path must lie under (decode.path_outside_root); None for a fetched URL
    size: int | None = None  # the bytes the source declares, where it knows them before reading (a tar member)


ROLES = ("system", "user", "assistant", "tool")
"""The roles a conversation's turns may have (HF / TRL `messages`); other formats' roles are mapped onto them."""


class Slot(enum.Enum):
    """A clip's place in a turn's content (an image's is None). An enum, so that it is itself again once a record has
    crossed to another process."""

    VIDEO = "<video>"


@dataclass(frozen=True)
class Turn:
    """One message of a conversation: its role, and its content in order: text pieces, None where an image sits and
    Slot.VIDEO where a clip sits (the k-th None of the conversation takes the record's k-th image, the k-th
    Slot.VIDEO its k-th clip)."""

    role: str
    content: tuple[str | Slot | None, ...]

    @property
    def num_images(self) -> int:
        return sum(part is None for part in self.content)

    @property
    def num_videos(self) -> int:
        return sum(part is Slot.VIDEO for part in self.content)

    @functools.cached_property  # (written past the frozen dataclass's __setattr__: a cache, not a field)
    def has_media(self) -> bool:
        return not all(type(part) is str for part in self.content)

    def text(self, placeholder: str) -> str:
        """The turn's text with `placeholder` where each image sits and `<video>` where each clip does (what a
        quarantine row and the report show)."""
        return "".join(placeholder if part is None else part.value if part is Slot.VIDEO else part
                       for part in self.content)


@dataclass
class SourceRecord:
    id: str | None
    unit_id: str
    source: str
    row: int
    text: str  # format=text: the text; a conversation: its turns as JSON, images as the placeholder
    images: list[ImageRef]
    seq: int = 0  # position within its unit: shards list records in this order
    failure: "Failure | None" = None  # a source.* check this record failed as it was read
    turns: list[Turn] | None = None  # a conversation (dataset.format other than text)
    videos: list[ImageRef] = field(default_factory=list)  # its clips (a conversation format's video column)


@dataclass
class DecodedImage:
    """HWC uint8 pixels, RGB or RGBA, upright (EXIF applied): a host array, or a tensor on the job's device where
    the JPEG was decoded there (decode.jpeg=device)."""

    pixels: np.ndarray | torch.Tensor
    format: str
    sha256: str

    def on_host(self) -> np.ndarray:
        return self.pixels if isinstance(self.pixels, np.ndarray) else self.pixels.cpu().numpy()

    @property
    def height(self) -> int:
        return int(self.pixels.shape[0])

    @property
    def width(self) -> int:
        return int(self.pixels.shape[1])

    @property
    def has_alpha(self) -> bool:
        return self.pixels.shape[2] == 4


@dataclass
class DecodedClip:
    """A clip's sampled frames, (n, H, W, 3) uint8 RGB, upright, in presentation order (`pixels`, as an image's, so
    that they cross from a worker as an image's pixels do), with what its plan and its row need of its header."""

    pixels: np.ndarray | torch.Tensor
    indices: tuple[int, ...]  # the sampled frames' positions among the clip's frames
    timestamps_s: tuple[float, ...]  # their times from the clip's first frame, from the pts
    total_frames: int
    fps: float

    @property
    def height(self) -> int:
        return int(self.pixels.shape[1])

    @property
    def width(self) -> int:
        return int(self.pixels.shape[2])


@dataclass
class EncodedJpeg:
    """A JPEG whose header passed the decode checks in the worker, left for the main process to decode in a batch
    on the job's device (decode.jpeg=device). Sized upright (its EXIF orientation applied), as the plan needs."""

    data: bytes
    height: int
    width: int
    orientation: int  # EXIF orientation, 1 (as stored) to 8
    sha256: str
    format: str = "JPEG"


@dataclass(frozen=True)
class ImagePlan:
    """The family's resize rule applied to one image. Sizes are (height, width)."""

    original: tuple[int, int]
    resized: tuple[int, int]
    padded: tuple[int, int]
    grid_thw: tuple[int, int, int]
    num_tokens: int

    @property
    def num_patches(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w


@dataclass
class TokenLayout:
    """The record's token sequence with placeholders expanded, and where each image sits in it."""

    input_ids: list[int]
    image_spans: list[tuple[int, int]]  # (start, length) per image, in image order
    token_tags: list[int]
    position_ids: np.ndarray | None = None  # [3, seq] M-RoPE positions, for families that use them
    rope_delta: int | None = None  # max position + 1 - seq: where decoding continues
    chat: "ChatLayout | None" = None  # a conversation: which tokens are trained, where each turn lies
    video_spans: list[tuple[int, int]] = field(default_factory=list)  # (start, length) per span of each clip (its
    # plan's `spans`: Qwen3-VL's per temporal patch, Kimi-K2.5's per chunk), in clip order


@dataclass
class TurnSpan:
    """Where a rendered turn lies in the expanded sequence: tokens [start, end), its end-of-turn token last."""

    role: str
    start: int
    end: int


@dataclass
class ChatLayout:
    """What a conversation adds to its token layout: the trained tokens, the turns kept, and how many trailing turns
    text.overflow=drop_turns left out."""

    loss_mask: list[int]  # per token: 1 trained, 0 not
    turns: list[TurnSpan]
    dropped_turns: int = 0


@dataclass
class PreprocessStats:
    """What preprocessing did to a record's images beyond its plan, kept by image index so that packing the record
    again (a batch bisected or redone) never counts an image twice. It rides on the record to its unit's manifest."""

    fallbacks: dict[int, str] = field(default_factory=dict)
    """image index -> the check whose failure sent the image to the CPU path"""
    parity_checked: set[int] = field(default_factory=set)
    parity_failed: set[int] = field(default_factory=set)

    def counts(self) -> dict:
        """The counts a manifest keeps (pipeline.preprocess.merged_stats adds them up)."""
        return {"fallbacks": dict(Counter(self.fallbacks.values())),
                "parity": {"checked_images": len(self.parity_checked), "failed_images": len(self.parity_failed)}}


def clip_parts(clip_plans: list) -> list:
    """The clips' plans as the tower encodes them and the output stores them (a grid, a span, tokens each): a clip
    whose plan has `parts` (Kimi-K2.5's chunks) is several, any other one."""
    return [part for plan in clip_plans for part in getattr(plan, "parts", (plan,))]


def clips_kept(clip_plans: list, spans: int) -> int:
    """How many clips a layout with `spans` clip spans holds (text.overflow=drop_turns drops the clips of dropped
    turns): the first ones, each with all its spans (Qwen3-VL: one per temporal patch; Kimi-K2.5: per chunk)."""
    kept = 0
    for plan in clip_plans:
        spans -= len(plan.spans)
        if spans < 0:
            break
        kept += 1
    return kept


@dataclass
class PreparedRecord:
    """A record ready for the device: decoded, planned and laid out (built in a worker)."""

    source: SourceRecord
    images: list[DecodedImage | EncodedJpeg]  # EncodedJpeg until the main process decodes it (decode.jpeg=device)
    plans: list[ImagePlan]
    layout: TokenLayout
    preprocess: PreprocessStats = field(default_factory=PreprocessStats)
    clips: list[DecodedClip] = field(default_factory=list)
    clip_plans: list = field(default_factory=list)  # the family's VideoPlan of each clip

    @property
    def media(self) -> list[DecodedImage | EncodedJpeg | DecodedClip]:
        """What the tower encodes for the record, in the order its outputs come back: its images, then its clips."""
        return [*self.images, *self.clips] if self.clips else self.images

    @property
    def media_plans(self) -> list:
        """What the tower encodes, each with its grid and tokens: the images' plans, then each clip's parts."""
        return [*self.plans, *clip_parts(self.clip_plans)] if self.clip_plans else self.plans

    @property
    def num_patches(self) -> int:
        return sum(plan.num_patches for plan in self.media_plans)


@dataclass
class EncodedRecord:
    prepared: PreparedRecord
    image_embeds: list[torch.Tensor]  # one [num_tokens_i, hidden] tensor per image
    extras: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    """Further outputs per image where the family has them (see format.schema.EXTRA_OUTPUTS)."""
    video_embeds: list[torch.Tensor] = field(default_factory=list)  # one [num_tokens_i, hidden] tensor per clip


@dataclass
class Failure:
    """What a failed check says: which check, where, what was expected and what was seen."""

    check: str
    stage: str
    message: str
    expected: str
    observed: str
    exception_type: str
    image_index: int | None = None
    turn_index: int | None = None  # a conversation: the turn the failure is about (e.g. where max_tokens falls)
    video_index: int | None = None  # the clip the failure is about


@dataclass
class QuarantinedRecord:
    source: SourceRecord
    failure: Failure
    preprocess: PreprocessStats = field(default_factory=PreprocessStats)  # where it failed after preprocessing


@dataclass
class OutputRow:
    """A record's row for its unit's shard of `kind` (data or quarantine), at its place (`source.seq`) in the unit."""

    source: SourceRecord
    kind: str
    values: dict
    preprocess: dict  # PreprocessStats.counts()


@dataclass
class Outcomes:
    """Records decided, in the order they were: encoded, or quarantined with their evidence."""

    records: list[EncodedRecord | QuarantinedRecord]


@dataclass
class Rows:
    """The rows of some decided records, each for its unit's shard of its kind."""

    rows: list[OutputRow]


@dataclass
class UnitStart:
    """Sent by a worker before the first record of a unit it has claimed."""

    unit: WorkUnit
    claim: object  # claims.Claim: the sink commits the unit only while it still holds it


@dataclass
class UnitEnd:
    """Sent by a worker after the last record of a unit, so the sink knows when the unit is whole."""

    unit: WorkUnit
    num_records: int


@dataclass
class PixelBatch:
    """Images of several records packed along the row axis, in the layout the tower takes."""

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor  # [num_images, 3] int64, on the host
    records: list[PreparedRecord] = field(default_factory=list)
    finite: torch.Tensor | None = None
    """Per image, on the pixels' device and not yet read: every value written and finite (preprocessing's check,
    read back with the tower's outputs); None where preprocessing read it already."""
