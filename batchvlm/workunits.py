"""Work units: their estimated cost, the plan every rank reads, and each rank's deterministic share.

Rank 0 estimates each unit's image tokens from the image headers (no pixels decoded, only the
allowlisted formats' header parsers run), writes `units.json` once, and every rank, in this run
and every restart, assigns from that file: the largest units first, each to the rank with the
fewest estimated tokens so far (ties to the lowest rank).
"""

from __future__ import annotations

import io
import json
import warnings
from dataclasses import asdict
from pathlib import Path

from PIL import Image

from batchvlm.config import ConfigError, DecodeConfig
from batchvlm.decode import read_bytes
from batchvlm.records import WorkUnit
from batchvlm.sink import durable_write_json
from batchvlm.source import Source


def header_tokens(data: bytes, family, cfg: DecodeConfig) -> int:
    """Planned tokens from the header alone; 0 for what decode will refuse anyway."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with Image.open(io.BytesIO(data), formats=list(cfg.formats)) as image:
                width, height = image.size
    except Exception:
        return 0
    if width * height > cfg.max_pixels or width < 1 or height < 1:
        return 0
    return family.plan(height, width).num_tokens


def estimate(source: Source, unit: WorkUnit, family, cfg: DecodeConfig) -> int:
    total = 0
    for record in source.records(unit):
        for index, ref in enumerate(record.images):
            try:
                total += header_tokens(read_bytes(ref, index), family, cfg)
            except Exception:
                continue
    return total


def plan_units(path: Path, source: Source, family, cfg: DecodeConfig) -> list[dict]:
    """The run's unit plan: read from `units.json`, or computed and written (rank 0 only calls this)."""
    units = source.units()
    if path.exists():
        plan = json.loads(path.read_text())
        if [entry["unit_id"] for entry in plan] != [unit.unit_id for unit in units]:
            raise ConfigError(f"{path} lists other work units than the dataset has now (the input files or "
                              "dataset.unit_size changed); use another run_name=... for a new run")
        return plan
    plan = [{**asdict(unit), "estimated_tokens": estimate(source, unit, family, cfg)} for unit in units]
    durable_write_json(path, plan)
    return plan


def read_plan(path: Path) -> list[dict]:
    return json.loads(path.read_text())


def assign(plan: list[dict], world: int) -> list[list[WorkUnit]]:
    """Longest-processing-time-first: deterministic, balanced by estimated tokens (rows break ties)."""
    shares: list[list[WorkUnit]] = [[] for _ in range(world)]
    load = [0] * world
    order = sorted(plan, key=lambda e: (-(e["estimated_tokens"] + e["stop"] - e["start"]), e["unit_id"]))
    for entry in order:
        rank = min(range(world), key=lambda r: (load[r], r))
        shares[rank].append(WorkUnit(entry["unit_id"], entry["source"], entry["start"], entry["stop"]))
        load[rank] += entry["estimated_tokens"] + entry["stop"] - entry["start"]
    return [sorted(share, key=lambda u: u.unit_id) for share in shares]
