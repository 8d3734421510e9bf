"""The unit plan: made once by rank 0 from the inputs' metadata, read by every rank of every restart.

The plan holds the inputs (name, location, size, identity), every setting that decides which rows are read and
what they mean, the units and the number of hash partitions of the duplicate pass. A restart lists the inputs
again (O(files)) and refuses a plan whose inputs or settings changed, naming the difference; it never reads a
footer or an image twice.
Ranks claim units dynamically (rundir.claims), the largest first, so the run ends on small units.
"""

from __future__ import annotations

import json
import math
import dataclasses
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

from batchvlm.config import ConfigError, JobConfig, differences
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


READ_ELSEWHERE = {"dataset": ("path", "storage_options")}
"""Settings that say where the inputs are, not what is read from them: the inputs' own identities stand for them."""


def reading_settings(job: JobConfig) -> dict:
    """Every setting that changes which rows a run reads or what they mean: the dataset's columns and rules, and the
    decode limits. A resume under other values would give a run whose units read different records."""
    dataset = {key: value for key, value in dataclasses.asdict(job.dataset).items()
               if key not in READ_ELSEWHERE["dataset"]}
    return {"dataset": dataset, "decode": dataclasses.asdict(job.decode)}


def _buckets(units: list[WorkUnit], configured: int | None) -> int:
    if configured is not None:
        return configured
    records = sum(u.num_rows if u.num_rows is not None else u.nbytes // BYTES_PER_UNKNOWN_RECORD + 1 for u in units)
    return max(1, math.ceil(records / IDS_PER_BUCKET))


def make_plan(layout: RunLayout, source: Plannable, job: JobConfig) -> tuple[Plan, bool]:
    """Rank 0: the run's plan, read back after checking that the inputs and the reading settings did not change, or
    made from the inputs' metadata (True: new, to be written once the run directory is the job's, `write_plan`)."""
    inputs, settings = list(source.inputs.values()), reading_settings(job)
    if layout.plan.exists():
        plan = read_plan(layout)
        _check_same_inputs(layout.plan, plan, inputs, settings)
        return plan, False
    units = source.plan()
    if not units:
        raise ConfigError(f"dataset.path={job.dataset.path!r}: the inputs hold no rows")
    return Plan(inputs, settings, units, _buckets(units, job.runtime.dedup_buckets)), True


def write_plan(layout: RunLayout, plan: Plan) -> None:
    durable_write_json(layout.plan, {"inputs": [asdict(i) for i in plan.inputs], "params": plan.params,
                                     "dedup_buckets": plan.dedup_buckets, "units": [asdict(u) for u in plan.units]})


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
                raw["dedup_buckets"])
