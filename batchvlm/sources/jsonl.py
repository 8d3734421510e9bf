"""JSON inputs: JSON Lines files (one record per line) and JSON arrays of records (LLaVA ships its 665k records as
one array), local or fsspec.

A record's `row` is the byte offset where it starts in its file, and a unit is a byte range of one file: the
records that start in [start, start + nbytes) (WorkUnit.stop is None: the count is known once read). So a unit is
read by seeking to it, and a requeue reads a record by its offset where the record there still has its id; a file
edited since moves its records, and the requeue finds them by id (sources.requeue).

- JSON Lines: units are cut at byte offsets of `dataset.unit_bytes` from the file's size alone, so planning costs
  O(files); a unit's first record is the first line that starts in it.
- A JSON array: rank 0 indexes it once at planning, one streamed pass that finds where each element starts and
  ends, and cuts units at element boundaries (`dataset.unit_records`, `dataset.unit_bytes`).

A line or element that is not a JSON object is quarantined under source.malformed_row. Bytes that are not UTF-8 are
read as Python's surrogateescape reads them, so that the record they sit in is quarantined alone, under
source.invalid_unicode, with its id.
"""

from __future__ import annotations

import codecs
import itertools
import json
from collections.abc import Iterator, Sequence

from batchvlm.checks import failure
from batchvlm.config import ConfigError
from batchvlm.records import InputFile, SourceRecord, WorkUnit
from batchvlm.sources import Source
from batchvlm.sources.files import list_files, open_input, parent_of
from batchvlm.sources.rows import record_from_row, record_id

UNDECODED = "surrogateescape"
"""How a byte that is not UTF-8 is read: as a surrogate that gives the byte back (the record then fails
source.invalid_unicode, alone)."""
CHUNK = 1 << 22
"""Bytes read at a time while indexing an array."""
WHITESPACE = " \t\r\n"


def is_array(handle) -> bool:
    """Whether a JSON file holds one array (else JSON Lines), from its first non-blank byte."""
    while chunk := handle.read(4096):
        stripped = chunk.lstrip(b" \t\r\n\xef\xbb\xbf")
        if stripped:
            return stripped[:1] == b"["
    return False


def array_elements(handle, start: int = 0) -> Iterator[tuple[int, int, object]]:
    """(byte offset, byte end, value) of each element of a JSON array, read in chunks: from the array's start (0), or
    from the element at byte `start` on."""
    decoder, utf8 = json.JSONDecoder(), codecs.getincrementaldecoder("utf-8")(errors=UNDECODED)
    handle.seek(start)
    text, at, offset, eof = "", 0, start, False  # text[at:] is unread; offset: the byte offset of text[at]

    def skip(chars: str) -> None:
        nonlocal at, offset
        begin = at
        while at < len(text) and text[at] in chars:
            at += 1
        offset += _nbytes(text[begin:at])

    def more() -> bool:
        nonlocal text, at, eof
        chunk = handle.read(CHUNK)
        eof = not chunk
        text = text[at:] + utf8.decode(chunk, final=eof)
        at = 0
        return not eof

    more()
    if start == 0:
        skip(WHITESPACE + "\ufeff")
        if text[at:at + 1] != "[":
            raise ValueError("not a JSON array")
        at, offset = at + 1, offset + 1
    while True:
        skip(WHITESPACE + ",")
        if at >= len(text) and more():
            continue
        if at >= len(text) or text[at] == "]":
            return
        try:
            value, end = decoder.raw_decode(text, at)
        except json.JSONDecodeError as error:
            # no value starts here (no later byte changes that), else the element may go on in the next chunk
            if not (error.msg == "Expecting value" and error.pos == at) and more():
                continue
            raise
        size = _nbytes(text[at:end])
        yield offset, offset + size, value
        at, offset = end, offset + size


def line_records(handle, start: int, stop: int | None) -> Iterator[tuple[int, bytes]]:
    """(byte offset, line) of each line that starts in [start, stop) (stop None: to the end)."""
    if start > 0:
        handle.seek(start - 1)
        position = start - 1 + len(handle.readline())  # the rest of the line that holds byte start - 1
    else:
        handle.seek(0)
        position = 0
    while stop is None or position < stop:
        line = handle.readline()
        if not line:
            return
        yield position, line
        position += len(line)


class JsonSource(Source):
    rows_are_offsets = True

    def list_inputs(self) -> list[InputFile]:
        return list_files(self.cfg.path, (".json", ".jsonl"), self.cfg.storage_options)

    def _open(self, item: InputFile):
        return open_input(item.location, self.cfg.storage_options)

    def _is_array(self, item: InputFile) -> bool:
        with self._open(item) as handle:
            return is_array(handle)

    def plan(self) -> Sequence[WorkUnit]:
        if (units := self.pattern_units()) is not None:
            return units
        return [unit for item in self.inputs.values()
                for unit in (self._plan_array(item) if self._is_array(item) else self._plan_lines(item))]

    def _plan_lines(self, item: InputFile) -> list[WorkUnit]:
        size = item.size if item.size is not None else self._size(item)
        if self.cfg.limit is not None:  # a smoke run: the bytes of the first `limit` lines
            with self._open(item) as handle:
                size = min(size, sum(len(line) for _, line in zip(range(self.cfg.limit), handle)))
        step = self.cfg.unit_bytes
        return [_unit(item.name, start, min(step, size - start)) for start in range(0, size, step)]

    def _size(self, item: InputFile) -> int:
        with self._open(item) as handle:
            return handle.seek(0, 2)

    def _plan_array(self, item: InputFile) -> list[WorkUnit]:
        units, first, end, count = [], None, 0, 0
        with self._open(item) as handle:
            try:
                for index, (start, stop, _) in enumerate(array_elements(handle)):
                    if index >= (self.cfg.limit or float("inf")):
                        break
                    if first is not None and (count >= self.cfg.unit_records or stop - first > self.cfg.unit_bytes):
                        units.append(_unit(item.name, first, end - first))
                        first, count = None, 0
                    first = start if first is None else first
                    end, count = stop, count + 1
            except ValueError as error:
                raise ConfigError(f"dataset.path: {item.location} is not a JSON array of records ({error})") from None
        if first is not None:
            units.append(_unit(item.name, first, end - first))
        return units

    def _values(self, item: InputFile, start: int, stop: int | None) -> Iterator[tuple[int, object]]:
        """(byte offset, value or the error that made it unreadable) of the records that start in [start, stop)."""
        with self._open(item) as handle:
            if is_array(handle):
                for offset, _, value in array_elements(handle, start):
                    if stop is not None and offset >= stop:
                        return
                    yield offset, value
                return
            for offset, line in line_records(handle, start, stop):
                if line.strip():
                    yield offset, _parsed(line)

    def _record(self, item: InputFile, unit_id: str, offset: int, seq: int, value) -> SourceRecord:
        if isinstance(value, dict):
            return record_from_row(self.cfg, value, unit_id, item, offset, seq, parent_of(item.location))
        record = SourceRecord(f"{item.name}#{offset}", unit_id, item.location, offset, "", [], seq)
        record.failure = failure("source.malformed_row", f"the record at byte {offset} is not a JSON object "
                                 f"({value})", expected="a JSON object", observed=str(value)[:200])
        return record

    def records(self, unit: WorkUnit) -> Iterator[SourceRecord]:
        item = self.inputs[unit.source]
        if self.pattern is None:
            values = self._values(item, unit.start, unit.start + unit.nbytes)
        else:  # a pattern's unit: its whole file, to the limit
            values = itertools.islice(self._values(item, 0, None), self.cfg.limit)
        for seq, (offset, value) in enumerate(values):
            yield self._record(item, unit.unit_id, offset, seq, value)

    def records_at(self, name: str, rows: list[int]) -> Iterator[SourceRecord]:
        """The records that start at these byte offsets; none where no record starts at one now (the file was edited:
        a requeue then finds the record by its id)."""
        item = self.inputs[name]
        for offset in rows:
            try:
                found = list(self._values(item, offset, offset + 1))
            except ValueError:  # inside an element of an array: no JSON value starts there
                continue
            for _, value in found:
                yield self._record(item, name, offset, offset, value)

    def all_ids(self, name: str) -> Iterator[tuple[int, str | None]]:
        item = self.inputs[name]
        for offset, value in self._values(item, 0, None):
            yield offset, record_id(self.cfg, value, name, offset) if isinstance(value, dict) else None

    def input_bytes(self, unit: WorkUnit, first: list[SourceRecord], rest: SourceRecord | None) -> int | None:
        """From where the first record starts to where the next one does (records' rows are their offsets)."""
        if rest is None:
            return unit.nbytes
        return rest.row - (first[0].row if first else unit.start)


def _nbytes(text: str) -> int:
    """The bytes the text was read from."""
    return len(text.encode("utf-8", UNDECODED))


def _parsed(line: bytes):
    try:
        return json.loads(line.decode("utf-8-sig", UNDECODED))
    except ValueError as error:  # JSONDecodeError (bytes that are not UTF-8 are read, not refused)
        return f"{type(error).__name__}: {error}"


def _unit(name: str, start: int, nbytes: int) -> WorkUnit:
    return WorkUnit(f"{name}-b{start:012d}", name, start, None, nbytes)


SOURCE = JsonSource
