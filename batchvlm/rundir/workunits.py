"""The unit plan: made once by rank 0 from the inputs' metadata, read by every rank of every restart.

`units.json` holds the inputs (name, location, size), the parameters that cut them, the units and
the number of hash partitions of the duplicate pass. A restart lists the inputs again (O(files))
and refuses a plan whose inputs or parameters changed; it never reads a footer or an image twice.
Ranks claim units dynamically (rundir.claims), the largest first, so the run ends on small units.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

from batchvlm.config import ConfigError, DatasetConfig
from batchvlm.records import InputFile, WorkUnit
from batchvlm.rundir.durable import durable_write_json
from batchvlm.rundir.layout import RunLayout
from batchvlm.rundir.manifest import Manifest, manifests_in_order
IDS_PER_BUCKET = 2_000_000
"""Planned records per hash partition of the duplicate pass: its memory is one partition's ids."""
BYTES_PER_UNKNOWN_RECORD = 100_000
"""For units whose record count only reading tells (tar shards): a guess from their bytes."""


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

    def manifests(self, layout: RunLayout) -> list[Manifest | None]:
        """Each unit's manifest in plan order (the order the first occurrence of an id is decided by), None
        where the unit is not committed."""
        return manifests_in_order(layout, [unit.unit_id for unit in self.units])

    def claim_order(self) -> list[WorkUnit]:
        """Largest first (bytes, then rows), so the last units any rank takes are small ones."""
        return sorted(self.units, key=lambda u: (-u.nbytes, -(u.num_rows or 0), u.unit_id))


def plan_params(cfg: DatasetConfig) -> dict:
    """What cuts the inputs into units: a plan made with other values is another plan."""
    return {"kind": cfg.kind, "unit_records": cfg.unit_records, "unit_bytes": cfg.unit_bytes, "limit": cfg.limit}


def _buckets(units: list[WorkUnit], configured: int | None) -> int:
    if configured is not None:
        return configured
    records = sum(u.num_rows if u.num_rows is not None else u.nbytes // BYTES_PER_UNKNOWN_RECORD + 1 for u in units)
    return max(1, math.ceil(records / IDS_PER_BUCKET))


def make_plan(layout: RunLayout, source: Plannable, cfg: DatasetConfig, dedup_buckets: int | None) -> Plan:
    """Rank 0: the run's plan, read back (after checking the inputs did not change) or made and written."""
    path = layout.plan
    inputs = list(source.inputs.values())
    if path.exists():
        plan = read_plan(layout)
        _check_same_inputs(path, plan, inputs, plan_params(cfg))
        return plan
    units = source.plan()
    if not units:
        raise ConfigError(f"dataset.path={cfg.path!r}: the inputs hold no rows")
    plan = Plan(inputs, plan_params(cfg), units, _buckets(units, dedup_buckets))
    durable_write_json(path, {"inputs": [asdict(i) for i in inputs], "params": plan.params,
                              "dedup_buckets": plan.dedup_buckets, "units": [asdict(u) for u in units]})
    return plan


def _check_same_inputs(path: Path, plan: Plan, inputs: list[InputFile], params: dict) -> None:
    changed = [f"{key}: {plan.params.get(key)!r} -> {value!r}" for key, value in params.items()
               if plan.params.get(key) != value]
    before, now = {i.name: i for i in plan.inputs}, {i.name: i for i in inputs}
    changed += [f"input {name} is gone" for name in before.keys() - now.keys()]
    changed += [f"input {now[name].location} is new" for name in now.keys() - before.keys()]
    changed += [f"input {now[name].location} changed size ({before[name].size} -> {now[name].size} bytes)"
                for name in before.keys() & now.keys() if before[name].size != now[name].size]
    if changed:
        raise ConfigError(f"{path} was planned from other inputs ({'; '.join(sorted(changed)[:5])}); "
                          "use another run_name=... for a new run")


def read_plan(layout: RunLayout) -> Plan:
    raw = json.loads(layout.plan.read_text())
    return Plan([InputFile(**i) for i in raw["inputs"]], raw["params"], [WorkUnit(**u) for u in raw["units"]],
                raw["dedup_buckets"])
