"""The unit plan: made once by rank 0 from the inputs' metadata, read by every rank of every restart.

The plan holds the inputs (name, location, size, identity), every setting that decides which rows are read and
what they mean, the units and the number of hash partitions of the duplicate pass. A restart lists the inputs
again (O(files)) and refuses a plan whose inputs or settings changed, naming the difference; it never reads a
footer or an image twice.
Ranks claim units dynamically, a block of consecutive units of the claim order at a time (rundir.frontier), the largest
first, so the run ends on small units.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

from batchvlm.config import ConfigError, differences
from batchvlm.records import InputFile, WorkUnit
from batchvlm.rundir.durable import durable_write_json
from batchvlm.rundir.layout import RunLayout
from batchvlm.rundir.manifest import Manifest, manifests_in_order
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
    """What planning needs of a source (sources.Source): its inputs, and its units cut from their metadata."""

    inputs: dict[str, InputFile]

    def plan(self) -> list[WorkUnit]: ...


@dataclass
class Plan:
    inputs: list[InputFile]
    params: dict
    units: list[WorkUnit]
    dedup_buckets: int
    block_units: int = 1

    def manifests(self, layout: RunLayout) -> list[Manifest | None]:
        """Each unit's manifest in plan order (the order the first occurrence of an id is decided by), None
        where the unit is not committed."""
        return manifests_in_order(layout, [unit.unit_id for unit in self.units])

    def claim_order(self) -> list[WorkUnit]:
        """Largest first (bytes, then rows), so the last units any rank takes are small ones."""
        return sorted(self.units, key=lambda u: (-u.nbytes, -(u.num_rows or 0), u.unit_id))

    def blocks(self) -> list[Block]:
        """The claim order cut into blocks of `block_units` units, in that order."""
        order = self.claim_order()
        return [Block(order[start].unit_id, tuple(order[start:start + self.block_units]))
                for start in range(0, len(order), self.block_units)]

    def block_of(self) -> dict[str, str]:
        """Each unit's block's task: the claim whose token names the unit's files."""
        return {unit.unit_id: block.task for block in self.blocks() for unit in block.units}


def _buckets(units: list[WorkUnit], configured: int | None) -> int:
    if configured is not None:
        return configured
    records = sum(u.num_rows if u.num_rows is not None else u.nbytes // BYTES_PER_UNKNOWN_RECORD + 1 for u in units)
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
    inputs = list(source.inputs.values())
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


def write_plan(layout: RunLayout, plan: Plan) -> None:
    durable_write_json(layout.plan, {"inputs": [asdict(i) for i in plan.inputs], "params": plan.params,
                                     "dedup_buckets": plan.dedup_buckets, "block_units": plan.block_units,
                                     "units": [asdict(u) for u in plan.units]})


def _check_same_inputs(path: Path, plan: Plan, inputs: list[InputFile], settings: dict) -> None:
    changed = [differences(plan.params, settings)] if plan.params != settings else []
    before, now = {i.name: i for i in plan.inputs}, {i.name: i for i in inputs}
    changed += [f"input {name} is gone" for name in before.keys() - now.keys()]
    changed += [f"input {now[name].location} is new" for name in now.keys() - before.keys()]
    changed += [f"input {now[name].location} changed ({differences(_identity(before[name]), _identity(now[name]))})"
                for name in before.keys() & now.keys() if _identity(before[name]) != _identity(now[name])]
    if changed:
        raise ConfigError(f"{path} was planned from other inputs or settings ({'; '.join(sorted(changed)[:5])}); "
                          "give the same inputs and settings to resume, or another run_name=... for a new run")


def _identity(item: InputFile) -> dict:
    return {"size": item.size, **item.identity}


def read_plan(layout: RunLayout) -> Plan:
    raw = json.loads(layout.plan.read_text())
    return Plan([InputFile(**i) for i in raw["inputs"]], raw["params"], [WorkUnit(**u) for u in raw["units"]],
                raw["dedup_buckets"], raw["block_units"])
