"""Brace patterns expanded lazily, and the plan of a pattern too large to list: one work unit per name it makes.

`shards/{000000000..999999999}.tar` names 10^9 files. Expanded into a list it would cost gigabytes before the first
unit, and listing or opening them would cost a billion metadata operations. Here a pattern is a sequence computed on
demand: its length is the product of its braces' choices, its i-th name is i read in their mixed radix (the last
brace turning fastest, as a shell expands them), and a name is read back to its position by the pattern's own
regular expression. A plan over such a pattern (`PatternInputs`, `PatternUnits`) is the pattern itself: the unit of
the i-th name is computed when it is claimed, its file opened when it is read.
"""

from __future__ import annotations

import math
import posixpath
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from batchvlm.config import ConfigError
from batchvlm.records import InputFile, WorkUnit

class Computed(Sequence):
    """A sequence whose items are computed when asked for: a subclass gives `__len__` and `item(index)` (0 <= index <
    len); slices, negative indices and iteration come from here."""

    def item(self, index: int):
        raise NotImplementedError

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self.item(i) for i in range(*index.indices(len(self)))]
        if not -len(self) <= index < len(self):
            raise IndexError(f"{index} of {len(self)}")
        return self.item(index % len(self))

    def __iter__(self) -> Iterator:
        return (self.item(index) for index in range(len(self)))


class ComputedMapping(Mapping):
    """A mapping computed key by key (from a pattern's plan): nothing is held, whatever its length."""

    def __init__(self, get: Callable, keys: Callable[[], Iterator], length: int):
        self.get_value, self.keys_of, self.length = get, keys, length

    def __getitem__(self, key):
        try:
            return self.get_value(key)
        except (KeyError, ValueError, IndexError):
            raise KeyError(key) from None

    def __iter__(self) -> Iterator:
        return self.keys_of()

    def __len__(self) -> int:
        return self.length


BRACES = re.compile(r"\{([^{}]*)\}")
RANGE = re.compile(r"(\d+)\.\.(\d+)")


@dataclass(frozen=True)
class NumberRange:
    """`{00000..00009}`: the numbers low to high, zero-padded to the width of `low` as written where it has a 0 first."""

    low: int
    high: int
    width: int
    regex = r"\d+"

    def __len__(self) -> int:
        return max(0, self.high - self.low + 1)

    def __getitem__(self, index: int) -> str:
        return str(self.low + index).zfill(self.width)

    def index(self, text: str) -> int:
        value = int(text)
        if not self.low <= value <= self.high or self[value - self.low] != text:
            raise ValueError(f"{text!r} is not in {self}")
        return value - self.low


@dataclass(frozen=True)
class Alternatives:
    """`{a,b}`: each alternative in turn."""

    options: tuple[str, ...]

    @property
    def regex(self) -> str:
        return "|".join(re.escape(option) for option in sorted(self.options, key=len, reverse=True))

    def __len__(self) -> int:
        return len(self.options)

    def __getitem__(self, index: int) -> str:
        return self.options[index]

    def index(self, text: str) -> int:
        return self.options.index(text)


class BracePattern(Computed):
    """The names a brace pattern stands for, left to right, each computed when asked for."""

    def __init__(self, pattern: str):
        self.pattern = pattern
        self.parts: list[str | NumberRange | Alternatives] = []
        at = 0
        for match in BRACES.finditer(pattern):
            self.parts += [pattern[at:match.start()], _choices(pattern, match.group(1))]
            at = match.end()
        self.parts.append(pattern[at:])
        if any("{" in part or "}" in part for part in self.parts if isinstance(part, str)):
            raise ConfigError(f"dataset.path={pattern!r}: its braces are nested or unpaired; a brace pattern is "
                              "ranges (00000..00009) and lists (a,b) side by side")
        self.choices = [part for part in self.parts if not isinstance(part, str)]
        self.length = math.prod(len(choice) for choice in self.choices)
        self.regex = re.compile("".join(re.escape(part) if isinstance(part, str) else f"({part.regex})"
                                        for part in self.parts))

    def __len__(self) -> int:
        return self.length

    def item(self, index: int) -> str:
        picked = []
        for choice in reversed(self.choices):
            index, digit = divmod(index, len(choice))
            picked.append(choice[digit])
        picked.reverse()
        return "".join(part if isinstance(part, str) else picked.pop(0) for part in self.parts)

    def index(self, name: str, *_) -> int:
        """The position of a name the pattern makes (ValueError for any other)."""
        match = self.regex.fullmatch(name)
        if match is None:
            raise ValueError(f"{name!r} is not a name of {self.pattern!r}")
        position = 0
        for choice, text in zip(self.choices, match.groups()):
            position = position * len(choice) + choice.index(text)
        if self[position] != name:
            raise ValueError(f"{name!r} is not a name of {self.pattern!r}")
        return position

    @property
    def folder(self) -> str:
        """The fixed folder every name lies in: the pattern's text before its first brace, up to its last slash."""
        return posixpath.dirname(self.pattern.split("{", 1)[0])


def _choices(pattern: str, body: str) -> NumberRange | Alternatives:
    if numbers := RANGE.fullmatch(body):
        low, high = numbers.groups()
        return NumberRange(int(low), int(high), len(low) if low.startswith("0") else 0)
    if "," in body:
        return Alternatives(tuple(body.split(",")))
    raise ConfigError(f"dataset.path={pattern!r}: {{{body}}} is neither a range (00000..00009) nor a list (a,b)")


def name_stem(relative: str) -> str:
    """A file's path below the inputs' common folder as the start of its input's name: safe in file names."""
    relative = re.sub(r"\.(parquet|tar)$", "", relative)
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", relative).strip("_.") or "input"


class PatternInputs(Computed):
    """The inputs of a pattern too large to list (sources.list_files), in the pattern's order: each an InputFile
    computed on demand, its location the pattern's name, its name that location below the pattern's fixed folder and
    its position (so a name is read back to its input with no listing), no size and no identity (nothing is listed).
    `unit_bytes` is the size of the first file, the one looked at: what each unit is planned to hold."""

    def __init__(self, pattern: str, unit_bytes: int = 0):
        self.names = BracePattern(pattern)
        self.unit_bytes = unit_bytes

    def __len__(self) -> int:
        return len(self.names)

    def item(self, index: int) -> InputFile:
        location = self.names.item(index)
        return InputFile(f"{name_stem(posixpath.relpath(location, self.names.folder))}-{index}", location)

    def position(self, name: str) -> int:
        """The position of an input by its name (KeyError for a name that is not one of them)."""
        _, _, digits = name.rpartition("-")
        if not digits.isdigit() or int(digits) >= len(self) or self[int(digits)].name != name:
            raise KeyError(name)
        return int(digits)

    def name_of(self, location: str) -> str | None:
        """The name of the input at `location`, None where the pattern makes no such name."""
        try:
            return self[self.names.index(location)].name
        except ValueError:
            return None

    @property
    def by_name(self) -> Mapping[str, InputFile]:
        """A source's `inputs` (name -> InputFile), each looked up by its position."""
        return ComputedMapping(lambda name: self[self.position(name)], lambda: (item.name for item in self), len(self))

    def to_json(self) -> dict:
        return {"pattern": self.names.pattern, "unit_bytes": self.unit_bytes}

    def __eq__(self, other) -> bool:
        """The same pattern (the first file's size is the plan's guess, not an identity)."""
        return isinstance(other, PatternInputs) and self.names.pattern == other.names.pattern


UNIT_SUFFIX = "-all"
"""A whole input's unit: `<input name>-all`, as a tar shard's always is."""


class PatternUnits(Computed):
    """The plan's units over a pattern's inputs: one per input, the whole file (its rows known once it is read),
    planned at the first file's size."""

    def __init__(self, inputs: PatternInputs):
        self.inputs = inputs

    def __len__(self) -> int:
        return len(self.inputs)

    def item(self, index: int) -> WorkUnit:
        item = self.inputs.item(index)
        return WorkUnit(f"{item.name}{UNIT_SUFFIX}", item.name, 0, None, self.inputs.unit_bytes)

    def position(self, unit_id: str) -> int:
        """The position of a unit by its id (KeyError for an id that is not one of them)."""
        if not unit_id.endswith(UNIT_SUFFIX):
            raise KeyError(unit_id)
        return self.inputs.position(unit_id[:-len(UNIT_SUFFIX)])
