"""WebDataset tar shards (img2dataset's `output_format=webdataset`), streamed member by member.

A sample is the run of consecutive members that share a key (the member's path up to the first dot
of its file name, WebDataset's `__key__`); its parts are named by the rest (`jpg`, `txt`, `json`).
`dataset.images_column` names the image part, `jpg;png;webp` meaning the first of these present
(WebDataset's own convention); `dataset.text_column` the caption part; `dataset.id_column` is
`__key__` or a field of the sample's `.json`, as is `dataset.status_column`; `dataset.videos_column` the clip
part (`mp4;webm;mkv`, the first present), else the `.json`'s field of that name.

A tar shard is one unit: its sample count is only known once it is read, so planning costs one
listing of the shards. An image member over decode.max_bytes (a clip member over video.max_bytes), by the size its
header declares, is never read into memory; a malformed sample (its .json not an object, no part the config names)
and a truncated shard's tail are quarantined under source.* checks, and the rest of the shard commits.
"""

from __future__ import annotations

import json
import math
import posixpath
import tarfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from batchvlm.checks import CheckFailed, failure
from batchvlm.records import InputFile, SourceRecord, WorkUnit
from batchvlm.sources import Source
from batchvlm.sources.files import list_files, open_input, parent_of
from batchvlm.sources.rows import record_from_row

KEY = "__key__"


def split_name(member: str) -> tuple[str, str]:
    """(key, part) of a member path: `dir/000123.jpg` -> (`dir/000123`, `jpg`)."""
    folder, base = posixpath.split(member)
    stem, _, part = base.partition(".")
    return posixpath.join(folder, stem), part.lower()


@dataclass(frozen=True)
class Unread:
    """A member the reader skipped: its declared size is over decode.max_bytes."""

    name: str
    size: int


@dataclass(frozen=True)
class Truncated:
    """Where a shard stopped being readable."""

    error: str


def samples(handle, max_bytes: int | None, image_parts: tuple[str, ...] = (), clip_parts: tuple[str, ...] = (),
            clip_max_bytes: int | None = None) -> Iterator[dict]:
    """Each sample of a tar stream as {__key__: key, part: bytes or Unread}, members never seeked back to; an image
    part over `max_bytes` (a clip part over `clip_max_bytes`) is not read; a shard that stops being readable ends
    with a Truncated."""
    limits = {part: max_bytes for part in image_parts} | {part: clip_max_bytes for part in clip_parts}
    sample: dict = {}
    try:
        with tarfile.open(fileobj=handle, mode="r|*") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                key, part = split_name(member.name)
                if sample and sample[KEY] != key:
                    yield sample
                    sample = {}
                sample[KEY] = key
                too_big = limits.get(part) is not None and member.size > limits[part]
                sample[part] = Unread(member.name, member.size) if too_big else tar.extractfile(member).read()
    except (tarfile.TarError, EOFError, OSError) as error:
        yield Truncated(f"{type(error).__name__}: {error}")
        return
    if sample:
        yield sample


class WebDatasetSource(Source):
    def list_inputs(self) -> list[InputFile]:
        return list_files(self.cfg.path, (".tar",), self.cfg.storage_options)

    def plan(self) -> Sequence[WorkUnit]:
        if (units := self.pattern_units()) is not None:
            return units
        return [WorkUnit(f"{item.name}-all", item.name, 0, None, item.size or 0) for item in self.inputs.values()]

    def _row(self, sample: dict, location: str) -> dict:
        """The sample as a row: its parts, the fields of its `.json`, the first image part present (raises
        CheckFailed for a sample that is not one)."""
        meta = _metadata(sample)
        parts = self.cfg.images_column.split(";")
        if not any(part in sample for part in [*parts, self.cfg.text_column, "json"]):
            raise CheckFailed("source.unrecognised_sample", f"the sample has none of the parts the config names "
                              f"({';'.join(parts)}, {self.cfg.text_column}, json)",
                              expected=", ".join([*parts, self.cfg.text_column, "json"]),
                              observed=", ".join(sorted(k for k in sample if k != KEY)))
        row = {**meta, **{part: value for part, value in sample.items() if part != "json"}}
        # An image part of the sample, else the .json's field of that name (paths, as LLaVA records give them)
        image = next((sample[part] for part in parts if part in sample), meta.get(self.cfg.images_column))
        row[self.cfg.images_column] = _member(image, location)
        if self.cfg.videos_column is not None:  # the clip part, else the .json's field (paths)
            clip_parts = self.cfg.videos_column.split(";")
            clip = next((sample[part] for part in clip_parts if part in sample), meta.get(self.cfg.videos_column))
            row[self.cfg.videos_column] = _member(clip, location)
        text = sample.get(self.cfg.text_column, meta.get(self.cfg.text_column))
        # Bytes that are not UTF-8 stay themselves (surrogateescape): the record fails source.invalid_unicode.
        row[self.cfg.text_column] = text.decode("utf-8", "surrogateescape") if isinstance(text, bytes) else text
        return row

    def _records(self, item: InputFile, unit_id: str, rows: set[int] | None) -> Iterator[SourceRecord]:
        with open_input(item.location, self.cfg.storage_options) as handle:
            image_parts = tuple(self.cfg.images_column.split(";"))
            clip_parts = tuple(self.cfg.videos_column.split(";")) if self.cfg.videos_column else ()
            for index, sample in enumerate(samples(handle, self.max_bytes, image_parts, clip_parts,
                                                   self.clip_max_bytes)):
                if index >= (self.cfg.limit or float("inf")):
                    return
                if rows is None or index in rows:
                    yield self._record(sample, item, unit_id, index)

    def _record(self, sample: dict | Truncated, item: InputFile, unit_id: str, index: int) -> SourceRecord:
        """A sample as a record; a malformed one, or a shard's unreadable tail, as a record that failed its check."""
        if isinstance(sample, Truncated):
            return self._failed(f"{item.name}#{index}", item, unit_id, index, failure(
                "source.truncated", f"the shard is not readable after {index} samples ({sample.error}); its tail "
                "is lost", expected="a complete tar", observed=sample.error))
        try:
            row = self._row(sample, item.location)
        except CheckFailed as failed:
            return self._failed(sample[KEY], item, unit_id, index, failed.to_failure())
        return record_from_row(self.cfg, row, unit_id, item, index, index, parent_of(item.location))

    def _failed(self, record_id: str, item: InputFile, unit_id: str, index: int, why) -> SourceRecord:
        return SourceRecord(id=record_id, unit_id=unit_id, source=item.location, row=index, text="", images=[],
                            seq=index, failure=why)

    def records(self, unit: WorkUnit) -> Iterator[SourceRecord]:
        return self._records(self.inputs[unit.source], unit.unit_id, None)

    def records_at(self, name: str, rows: list[int]) -> Iterator[SourceRecord]:
        return self._records(self.inputs[name], name, set(rows))

    def all_ids(self, name: str) -> Iterator[tuple[int, str | None]]:
        for record in self._records(self.inputs[name], name, None):
            yield record.row, record.id

    def input_bytes(self, unit: WorkUnit, first: list[SourceRecord], rest: SourceRecord | None) -> int | None:
        """The shard's size where the records are all of it, else their members' blocks."""
        return unit.nbytes if rest is None else sum(_tar_bytes(record) for record in first)


def _member(value, location: str):
    """A part as the row holds it: its bytes, or where it was not read (Unread) its place and size, which the decoder
    refuses by that size (decode.too_many_bytes, video.too_many_bytes)."""
    if isinstance(value, Unread):
        return {"bytes": None, "path": f"{location}#{value.name}", "size": value.size}
    return value


TAR_BLOCK = 512


def _tar_bytes(record: SourceRecord) -> int:
    """What a record takes in a tar shard: its image, clip and text members, each a header and whole blocks."""
    sizes = [len(ref.data) if ref.data is not None else ref.size or 0 for ref in [*record.images, *record.videos]]
    sizes.append(len(record.text))
    return sum(TAR_BLOCK + math.ceil(size / TAR_BLOCK) * TAR_BLOCK for size in sizes)


def _metadata(sample: dict) -> dict:
    """The fields of the sample's `.json` (raises CheckFailed where it is not a JSON object)."""
    if "json" not in sample:
        return {}
    raw = sample["json"]
    try:
        meta = json.loads(raw) if isinstance(raw, bytes) else None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckFailed("source.bad_metadata", f"the sample's .json is not JSON ({error})", expected="a JSON object",
                          observed=repr(raw[:80])) from None
    if not isinstance(meta, dict):
        raise CheckFailed("source.bad_metadata", "the sample's .json is not a JSON object", expected="a JSON object",
                          observed=type(meta).__name__)
    return meta


SOURCE = WebDatasetSource
