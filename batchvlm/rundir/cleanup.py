"""Keeping a run directory true to its manifests: units whose files are not whole are uncommitted (and so redone), and
what dead claims left is removed. Nothing else is ever deleted.

A file is removed only when all of these hold: it lies in a unit folder, no manifest lists it, its name is one
batchvlm writes for a unit of this run's plan (`<unit>.<claim token>[-<n>].parquet`, or such a file or a manifest on
its way to being published), and the claim that wrote it (the claim on the unit's block) is dead (rundir.claims:
fenced, and its holder's lease expired).
A live holder's files, a second job's, and anything the job did not name itself stay.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

from batchvlm.rundir.claims import Claims
from batchvlm.rundir.layout import RunLayout
from batchvlm.rundir.manifest import (DamagedFile, Manifest, ManifestError, all_manifests, checked, committed_units,
                                     orphans, read_manifest)

log = logging.getLogger("batchvlm")


def not_whole(layout: RunLayout, manifest: Manifest) -> str | None:
    """Why a committed unit is not whole (a listed file missing, or not at its recorded size), or None."""
    for listing in manifest.listings():
        try:
            checked(layout, listing)
        except DamagedFile as damaged:
            return str(damaged)
    return None


def uncommit_broken(layout: RunLayout) -> list[str]:
    """Units whose manifest is unreadable or whose files are not whole lose their commit, to be redone; the duplicate
    pass's index and results, made from their ids, go with them. The units uncommitted."""
    broken = []
    for unit in sorted(committed_units(layout)):
        path = layout.manifest(unit)
        try:
            why = not_whole(layout, read_manifest(path))
        except ManifestError as error:
            why = str(error)
        if why is not None:
            log.warning("unit %s is not whole (%s): its commit is withdrawn and the unit is redone", unit, why)
            path.unlink(missing_ok=True)
            broken.append(unit)
    if broken:
        layout.dedup_index.unlink(missing_ok=True)
        for result in layout.committed_buckets():
            layout.bucket_duplicates(int(result.stem)).unlink(missing_ok=True)
            result.unlink(missing_ok=True)
    return broken


def stale_files(layout: RunLayout, tasks: Mapping[str, str], claims: Claims) -> list[Path]:
    """The files of dead claims on this plan's units that no manifest lists (see the module's rule); `tasks` maps
    each unit of the plan to the task it is claimed under (its block's, rundir.workunits)."""
    manifests = all_manifests(layout)
    committed_by = {manifest.unit: manifest.claim for manifest in manifests}
    found = []
    for path in orphans(layout, manifests):
        written_by = layout.claim_of(path)
        if written_by is None or written_by[0] not in tasks:
            continue  # a name batchvlm does not write for this run: never touched
        unit, token = written_by
        if claims.dead(tasks[unit], token, committed_by.get(unit)):
            found.append(path)
    return found


def remove_stale(layout: RunLayout, tasks: Mapping[str, str], claims: Claims) -> list[Path]:
    found = stale_files(layout, tasks, claims)
    for path in found:
        path.unlink(missing_ok=True)
    return found
