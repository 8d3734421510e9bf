"""WebDataset tar shards (img2dataset's `output_format=webdataset`), streamed member by member.

A sample is the run of consecutive members that share a key (the member's path up to the first dot
of its file name, WebDataset's `__key__`); its parts are named by the rest (`jpg`, `txt`, `json`).
`dataset.images_column` names the image part, `jpg;png;webp` meaning the first of these present
(WebDataset's own convention); `dataset.text_column` the caption part; `dataset.id_column` is
`__key__` or a field of the sample's `.json`, as is `dataset.status_column`.

A tar shard is one unit: its sample count is only known once it is read, so planning costs one
listing of the shards.
"""

from __future__ import annotations

import json
import posixpath
import tarfile
from collections.abc import Iterator

from batchvlm.records import InputFile, SourceRecord, WorkUnit
from batchvlm.sources import Source, list_files, open_input, parent_of, record_from_row

KEY = "__key__"


def split_name(member: str) -> tuple[str, str]:
    """(key, part) of a member path: `dir/000123.jpg` -> (`dir/000123`, `jpg`)."""
    folder, base = posixpath.split(member)
    stem, _, part = base.partition(".")
    return posixpath.join(folder, stem), part.lower()


def samples(handle) -> Iterator[dict[str, bytes | str]]:
    """Each sample of a tar stream as {__key__: key, part: bytes}; members are never seeked back to."""
    sample: dict = {}
    with tarfile.open(fileobj=handle, mode="r|*") as tar:
        for member in tar:
            if not member.isfile():
                continue
            key, part = split_name(member.name)
            if sample and sample[KEY] != key:
                yield sample
                sample = {}
            sample[KEY] = key
            sample[part] = tar.extractfile(member).read()
    if sample:
        yield sample


class WebDatasetSource(Source):
    def list_inputs(self) -> list[InputFile]:
        return list_files(self.cfg.path, (".tar",), self.cfg.storage_options)

    def plan(self) -> list[WorkUnit]:
        return [WorkUnit(f"{item.name}-all", item.name, 0, None, item.size or 0) for item in self.inputs.values()]

    def _row(self, sample: dict) -> dict:
        """The sample as a row: its parts, the fields of its `.json`, the first image part present."""
        meta = json.loads(sample["json"]) if "json" in sample else {}
        row = {**meta, **{part: value for part, value in sample.items() if part != "json"}}
        parts = self.cfg.images_column.split(";")
        # An image part of the sample, else the .json's field of that name (paths, as LLaVA records give them)
        row[self.cfg.images_column] = next((sample[part] for part in parts if part in sample),
                                           meta.get(self.cfg.images_column))
        text = sample.get(self.cfg.text_column, meta.get(self.cfg.text_column))
        row[self.cfg.text_column] = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
        return row

    def _records(self, item: InputFile, unit_id: str, rows: set[int] | None) -> Iterator[SourceRecord]:
        with open_input(item.location, self.cfg.storage_options) as handle:
            for index, sample in enumerate(samples(handle)):
                if index >= (self.cfg.limit or float("inf")):
                    return
                if rows is None or index in rows:
                    yield record_from_row(self.cfg, self._row(sample), unit_id, item.location, index, index,
                                          parent_of(item.location))

    def records(self, unit: WorkUnit) -> Iterator[SourceRecord]:
        return self._records(self.inputs[unit.source], unit.unit_id, None)

    def records_at(self, name: str, rows: list[int]) -> Iterator[SourceRecord]:
        return self._records(self.inputs[name], name, set(rows))

    def all_ids(self, name: str) -> Iterator[tuple[int, str | None]]:
        for record in self._records(self.inputs[name], name, None):
            yield record.row, record.id


SOURCE = WebDatasetSource
