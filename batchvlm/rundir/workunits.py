"""The unit plan: made once by rank 0 from the inputs' metadata, read by every rank of every restart.

The plan holds the inputs (name, location, size, identity), every setting that decides which rows are read and
what they mean, the units and the number of hash partitions of the duplicate pass. A restart lists the inputs
again (O(files)) and refuses a plan whose inputs or settings changed, naming the difference; it never reads a
footer or an image twice.
Ranks claim units dynamically, a block of consecutive units of the claim order at a time (rundir.frontier), the largest
first, so the run ends on small units.

A brace pattern too large to list (sources.LISTED_NAMES) is planned from the pattern alone (rundir.patterns): its
inputs and units are the pattern, one unit per name computed when it is claimed, in the pattern's order, and the plan
file holds the pattern, not a list; a resume checks the pattern.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

from batchvlm.config import ConfigError, differences
from batchvlm.records import InputFile, WorkUnit
from batchvlm.rundir.durable import DamagedMetadata, durable_write_json, read_json
from batchvlm.rundir.layout import RunLayout
from batchvlm.rundir.manifest import Manifest, manifests_in_order
from batchvlm.rundir.patterns import Computed, ComputedMapping, PatternInputs, PatternUnits

IDS_PER_BUCKET = 2_000_000
"""Planned records per hash partition of the duplicate pass: its memory is one partition's ids."""
BYTES_PER_UNKNOWN_RECORD = 100_000
"""For units whose record count only reading tells (tar shards): a guess from their bytes."""
BLOCKS_PER_RANK = 8
"""Blocks each rank of the launch that plans a run gets at least, where the units allow: fewer units per block
rather than a rank with nothing to do while another works through a long block."""


@dataclass(frozen=True)
class Block:
    """Consecutive units of the claim order, claimed as one task and worked through by the rank that holds it. Its
    task is its first unit's id, so a plan of one unit per block claims units by their ids."""

    task: str
    units: tuple[WorkUnit, ...]


class Plannable(Protocol):
    """What planning needs of a source (sources.Source): its inputs (a pattern's, where too large to list), and its
    units cut from their metadata."""

    inputs: Mapping[str, InputFile]
    pattern: PatternInputs | None

    def plan(self) -> Sequence[WorkUnit]: ...


class Blocks(Computed):
    """A claim order cut into blocks of `size` units, in that order, each made when asked for."""

    def __init__(self, order: Sequence[WorkUnit], size: int):
        self.order, self.size = order, size

    def __len__(self) -> int:
        return math.ceil(len(self.order) / self.size)

    def item(self, index: int) -> Block:
        start = index * self.size
        return Block(self.order[start].unit_id, tuple(self.order[start:start + self.size]))

    @property
    def tasks(self) -> Sequence[str]:
        """Each block's task, in claim order (what the frontier walks)."""
        return _Tasks(self)


class _Tasks(Computed):
    def __init__(self, blocks: Blocks):
        self.blocks = blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def item(self, index: int) -> str:
        return self.blocks.order[index * self.blocks.size].unit_id


@dataclass
class Plan:
    inputs: Sequence[InputFile]  # a pattern's (PatternInputs) where it was too large to list
    params: dict
    units: Sequence[WorkUnit]  # then its PatternUnits
    dedup_buckets: int
    block_units: int = 1

    @property
    def from_pattern(self) -> bool:
        """Planned from a pattern too large to list: nothing of it is held, each unit is computed when asked for."""
        return isinstance(self.units, PatternUnits)

    def manifests(self, layout: RunLayout) -> list[Manifest | None]:
        """Each unit's manifest in plan order (the order the first occurrence of an id is decided by), None
        where the unit is not committed."""
        return manifests_in_order(layout, (unit.unit_id for unit in self.units))

    def claim_order(self) -> Sequence[WorkUnit]:
        """Largest first (bytes, then rows), so the last units any rank takes are small ones; a pattern's in its own
        order (no size is known before its files are read)."""
        if self.from_pattern:
            return self.units
        return sorted(self.units, key=lambda u: (-u.nbytes, -(u.num_rows or 0), u.unit_id))

    def blocks(self) -> Blocks:
        """The claim order cut into blocks of `block_units` units, in that order."""
        return Blocks(self.claim_order(), self.block_units)

    def block_of(self) -> Mapping[str, str]:
        """Each unit's block's task: the claim whose token names the unit's files."""
        if not self.from_pattern:
            return {unit.unit_id: block.task for block in self.blocks() for unit in block.units}
        tasks = self.blocks().tasks
        return ComputedMapping(lambda unit_id: tasks[self.units.position(unit_id) // self.block_units],
                               lambda: (unit.unit_id for unit in self.units), len(self.units))

    def blocks_by_task(self) -> Mapping[str, Block]:
        """Each block by its task."""
        blocks = self.blocks()
        if not self.from_pattern:
            return {block.task: block for block in blocks}

        def block(task: str) -> Block:
            position = self.units.position(task)
            if position % self.block_units:
                raise KeyError(task)
            return blocks[position // self.block_units]

        return ComputedMapping(block, lambda: iter(blocks.tasks), len(blocks))

    def locations(self) -> Mapping[str, str]:
        """Each input's location by its name."""
        if not self.from_pattern:
            return {item.name: item.location for item in self.inputs}
        by_name = self.inputs.by_name
        return ComputedMapping(lambda name: by_name[name].location, lambda: iter(by_name), len(by_name))

    def rows(self) -> int | None:
        """The rows of every unit, where every unit knows its rows before it is read (not a pattern's)."""
        if self.from_pattern:
            return None
        rows = [unit.num_rows for unit in self.units]
        return None if None in rows else sum(rows)


def _buckets(units: Sequence[WorkUnit], configured: int | None) -> int:
    if configured is not None:
        return configured
    guess = lambda u: u.num_rows if u.num_rows is not None else u.nbytes // BYTES_PER_UNKNOWN_RECORD + 1  # noqa: E731
    # a pattern's units are all planned alike: its first one, times their number
    records = len(units) * guess(units[0]) if isinstance(units, PatternUnits) else sum(map(guess, units))
    return max(1, math.ceil(records / IDS_PER_BUCKET))


def block_units_for(units: list[WorkUnit], configured: int, world: int) -> int:
    """Units per block: `configured` (runtime.block_units), fewer where `world` ranks would get under
    BLOCKS_PER_RANK blocks each."""
    return max(1, min(configured, len(units) // (BLOCKS_PER_RANK * world)))


def make_plan(layout: RunLayout, source: Plannable, settings: dict, world: int = 1, dedup_buckets: int | None = None,
              block_units: int = 8) -> tuple[Plan, bool]:
    """Rank 0: the run's plan, read back after checking that the inputs and the reading `settings` (every setting that
    changes which rows a run reads or what they mean) did not change, or made from the inputs' metadata (True: new, to
    be written once the run directory is the job's, `write_plan`); `world`, the launch's ranks, sizes its blocks of at
    most `block_units` units (runtime.block_units); `dedup_buckets` (runtime.dedup_buckets) the duplicate pass."""
    inputs = source.pattern if source.pattern is not None else list(source.inputs.values())
    if layout.plan.exists():
        plan = read_plan(layout)
        _check_same_inputs(layout.plan, plan, inputs, settings)
        return plan, False
    units = source.plan()
    if not units:
        raise ConfigError(f"dataset.path: the inputs hold no rows ({', '.join(i.location for i in inputs[:3])}"
                          f"{', ...' if len(inputs) > 3 else ''})")
    blocks = block_units_for(units, block_units, world)
    return Plan(inputs, settings, units, _buckets(units, dedup_buckets), blocks), True


PATTERN = "pattern"
"""The plan file's key for a pattern's inputs and units (its `inputs`, where a listed plan has a list)."""


def write_plan(layout: RunLayout, plan: Plan) -> None:
    inputs, units = (([asdict(i) for i in plan.inputs], [asdict(u) for u in plan.units]) if not plan.from_pattern else
                     ({PATTERN: plan.inputs.to_json()}, {PATTERN: "one unit per input"}))
    durable_write_json(layout.plan, {"inputs": inputs, "params": plan.params, "dedup_buckets": plan.dedup_buckets,
                                     "block_units": plan.block_units, "units": units})


def _check_same_inputs(path: Path, plan: Plan, inputs: Sequence[InputFile], settings: dict) -> None:
    changed = [differences(plan.params, settings)] if plan.params != settings else []
    if plan.from_pattern or isinstance(inputs, PatternInputs):
        if plan.inputs != inputs:
            changed.append(f"the inputs were {_described(plan.inputs)}, now {_described(inputs)}")
    else:
        changed += _listed_changes(plan.inputs, inputs)
    if changed:
        raise ConfigError(f"{path} was planned from other inputs or settings ({'; '.join(sorted(changed)[:5])}); "
                          "give the same inputs and settings to resume, or another run_name=... for a new run")


def _listed_changes(planned: Sequence[InputFile], inputs: Sequence[InputFile]) -> list[str]:
    before, now = {i.name: i for i in planned}, {i.name: i for i in inputs}
    changed = [f"input {name} is gone" for name in before.keys() - now.keys()]
    changed += [f"input {now[name].location} is new" for name in now.keys() - before.keys()]
    changed += [f"input {now[name].location} changed ({differences(_identity(before[name]), _identity(now[name]))})"
                for name in before.keys() & now.keys() if _identity(before[name]) != _identity(now[name])]
    return changed


def _identity(item: InputFile) -> dict:
    return {"size": item.size, **item.identity}


def _described(inputs: Sequence[InputFile]) -> str:
    return f"the pattern {inputs.names.pattern}" if isinstance(inputs, PatternInputs) else f"{len(inputs)} listed files"


def read_plan(layout: RunLayout) -> Plan:
    """The run's plan; DamagedMetadata where units.json is not one (another tool's file, a truncated copy)."""
    raw = read_json(layout.plan)
    if raw is None:
        raise DamagedMetadata.of(layout.plan, "a batchvlm plan", FileNotFoundError("no such file"))
    try:
        if isinstance(raw["inputs"], dict):
            inputs = PatternInputs(**raw["inputs"][PATTERN])
            return Plan(inputs, raw["params"], PatternUnits(inputs), raw["dedup_buckets"], raw["block_units"])
        return Plan([InputFile(**i) for i in raw["inputs"]], raw["params"], [WorkUnit(**u) for u in raw["units"]],
                    raw["dedup_buckets"], raw["block_units"])
    except (KeyError, TypeError, ConfigError) as error:
        raise DamagedMetadata.of(layout.plan, "a batchvlm plan", error) from None
