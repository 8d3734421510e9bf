"""Requeue: run only the quarantined records of an earlier run again, read afresh from the current dataset.

The earlier run's quarantine shards (those its manifests list) name each record by input file, row
and id. Each record is found again in the dataset of the current config, by file and row where the id
there still matches, else by id, so a text fixed in the dataset file is what runs now. The rows found
become work units of their own, named after the rows chosen, so a requeue run resumes and commits
exactly once like any run. `lineage.json` in the new run says where each record came from, under which
check, and which records could no longer be found.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import pyarrow.parquet as pq

from batchvlm.config import ConfigError
from batchvlm.sources.config import DatasetConfig
from batchvlm.records import WorkUnit
from batchvlm.rundir.durable import durable_write_json, read_json
from batchvlm.rundir.layout import DATA, QUARANTINE, RunLayout
from batchvlm.rundir.manifest import listed_shards
from batchvlm.rundir.upgrade import check_run_format
from batchvlm.sources import Source, make_source
from batchvlm.sources.rows import CONTENT_ID

log = logging.getLogger("batchvlm")


@dataclass(frozen=True)
class Quarantined:
    """Where an earlier run found a record, and the check it failed."""

    id: str
    source: str
    row: int
    check: str
    stage: str


@dataclass(frozen=True)
class Located:
    """A quarantined record found again: the input (by name) and row it is read from now."""

    was: Quarantined
    input: str
    row: int
    matched_by: str  # "row": same file and row, same id; "id": the id found elsewhere in the dataset; "position":
    # same file and row, both ids made from content (the record was edited)


def quarantined_records(run_dir: Path, checks: list[str] | None) -> list[Quarantined]:
    """The quarantined records of a run (only those of `checks`, if given), streamed from its shards."""
    layout = RunLayout(run_dir)
    if not layout.manifests.is_dir():
        raise ConfigError(f"requeue_from={str(run_dir)!r} is not a batchvlm run directory (no "
                          f"{layout.name_of(layout.manifests)}/ folder)")
    records = []
    for _, shard in listed_shards(layout, QUARANTINE):
        for batch in pq.ParquetFile(shard).iter_batches(columns=["id", "source", "row", "check", "stage"]):
            records += [Quarantined(**row) for row in batch.to_pylist() if checks is None or row["check"] in checks]
    return records


def written_ids(run_dir: Path) -> set[str]:
    """The ids a run holds in its data shards (its first occurrences, and the later ones the readers leave out)."""
    ids = set()
    for _, shard in listed_shards(RunLayout(run_dir), DATA):
        for batch in pq.ParquetFile(shard).iter_batches(columns=["id"]):
            ids.update(batch.column("id").to_pylist())
    return ids


def _index_by_id(source: Source, wanted: set[str]) -> dict[str, tuple[str, int]]:
    """The first (input, row) of each wanted id in the dataset: one scan of its ids, built only when some record moved,
    holding the wanted ids alone."""
    index: dict[str, tuple[str, int]] = {}
    for name in source.inputs:
        for row, record_id in source.all_ids(name):
            if record_id in wanted:
                index.setdefault(record_id, (name, row))
    return index


def locate(source: Source, wanted: list[Quarantined]) -> tuple[list[Located], list[Quarantined]]:
    """Find each wanted record in the current dataset: by file and row with the same id, else by id. A record whose id
    was made from its content (dataset.missing_ids=content) and is found by neither was edited (so was its id): it is
    the record with a made id that starts where it started, if one does."""
    name_at = _names_by_location(source)
    rows_of: dict[str, list[int]] = {}
    for record in wanted:
        name = name_at(record.source)
        if name is not None:
            rows_of.setdefault(name, []).append(record.row)
    id_at = {}
    for name, rows in rows_of.items():
        id_at.update({(name, record.row): record.id for record in source.records_at(name, sorted(set(rows)))})
    by_id = None
    found, missing, taken = [], [], set()
    for record in wanted:
        here = (name_at(record.source), record.row)
        # a record quarantined for a missing id had no id to compare: its row is all there is
        if here in id_at and (id_at[here] == record.id or record.check == "source.missing_id"):
            place, matched_by = here, "row"
        else:
            by_id = _index_by_id(source, {item.id for item in wanted}) if by_id is None else by_id
            place, matched_by = by_id.get(record.id), "id"
            if place is None and _made_from_content(source, id_at.get(here)) and _made_from_content(source, record.id):
                place, matched_by = here, "position"
        if place is None or place in taken:
            missing.append(record)
            continue
        taken.add(place)
        found.append(Located(record, place[0], place[1], matched_by))
    return found, missing


def _made_from_content(source: Source, record_id: str | None) -> bool:
    return source.cfg.missing_ids == "content" and record_id is not None and record_id.startswith(CONTENT_ID)


def _names_by_location(source: Source) -> Callable[[str], str | None]:
    """An input's name by its location (the same file by another path too, locally); a pattern too large to list
    reads the name off the location."""
    if source.pattern is not None:
        return source.pattern.name_of
    by_location = {_same_place(item.location): name for name, item in source.inputs.items()}
    return lambda location: by_location.get(_same_place(location))


def _same_place(location: str) -> str:
    return location if "://" in location else os.path.realpath(location)


class RequeueSource(Source):
    """The current dataset narrowed to the rows that an earlier run quarantined, in input order.

    Records keep their input file, row and id; units are runs of `dataset.unit_records` chosen rows whose
    ids carry a digest of the rows, so a changed selection can never resume into the old plan.
    """

    def __init__(self, cfg: DatasetConfig, run_dir: Path, checks: list[str] | None):
        check_run_format(RunLayout(run_dir))
        self.base = make_source(cfg)
        super().__init__(cfg, self.base.pattern if self.base.pattern is not None else list(self.base.inputs.values()))
        self.from_run, self.checks = run_dir.resolve(), checks
        quarantined = quarantined_records(run_dir, checks)
        if not quarantined:
            raise ConfigError(f"nothing to requeue: {run_dir} has no quarantined records"
                              + (f" under check={','.join(checks)}" if checks else ""))
        held = written_ids(run_dir)  # a record whose id the run already wrote would be written twice
        self.not_requeued = [record for record in quarantined if record.id in held]
        wanted = [record for record in quarantined if record.id not in held]
        if not wanted:
            raise ConfigError(f"nothing to requeue: the id of each of the {len(quarantined)} quarantined records of "
                              f"{run_dir} is already written in its data (a later occurrence of the id)")
        self.found, self.not_found = locate(self.base, wanted)
        if not self.found:
            raise ConfigError(f"none of the {len(wanted)} quarantined records of {run_dir} is in the current dataset "
                              f"({cfg.described()}); requeue with the dataset "
                              f"overrides of the original run (see {RunLayout(run_dir).config})")
        self.rows: dict[str, list[int]] = {}
        for located in self.found:
            self.rows.setdefault(located.input, []).append(located.row)
        for rows in self.rows.values():
            rows.sort()

    def plan(self) -> list[WorkUnit]:
        size = self.cfg.unit_records
        units = []
        for name, rows in self.rows.items():
            digest = hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:8]
            units += [WorkUnit(f"{name}-requeue-{digest}-{start:08d}-{min(start + size, len(rows)):08d}", name, start,
                               min(start + size, len(rows))) for start in range(0, len(rows), size)]
        return units

    def records(self, unit: WorkUnit):
        for seq, record in enumerate(self.base.records_at(unit.source, self.rows[unit.source][unit.start:unit.stop])):
            record.unit_id, record.seq = unit.unit_id, seq
            yield record

    def lineage(self) -> dict:
        return {
            "requeue_from": str(self.from_run),
            "checks": self.checks,
            "requeued": [{"id": located.was.id, "check": located.was.check, "stage": located.was.stage,
                          "from_source": located.was.source, "from_row": located.was.row,
                          "source": self.inputs[located.input].location, "row": located.row,
                          "matched_by": located.matched_by} for located in self.found],
            "not_found": [asdict(record) for record in self.not_found],
            "not_requeued": [{**asdict(record), "reason": "the run already holds this id in its data"}
                             for record in self.not_requeued],
        }


def requeue_source(dataset: DatasetConfig, requeue_from: str, checks: list[str] | None,
                   run_dir: Path) -> RequeueSource:
    """The source of a requeue run (of the records of `requeue_from` quarantined under `checks`, or all); refuses to
    write the new run into the run it reads."""
    from_run = Path(requeue_from)
    if from_run.resolve() == run_dir.resolve():
        raise ConfigError(f"requeue_from={requeue_from!r} is the run directory of this job; "
                          "give the requeue another run_name=...")
    source = RequeueSource(dataset, from_run, checks)
    log.info("requeue of %s: %d quarantined records found in the current dataset, %d not found", from_run,
             len(source.found), len(source.not_found))
    for record in source.not_found:
        log.warning("not requeued: %s (%s, row %d, %s) is no longer in the dataset", record.id, record.source,
                    record.row, record.check)
    return source


def write_lineage(layout: RunLayout, source: RequeueSource) -> None:
    durable_write_json(layout.lineage, source.lineage())


def read_lineage(layout: RunLayout) -> dict | None:
    return read_json(layout.lineage)
