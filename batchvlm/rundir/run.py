"""The run directory: resolved config, fingerprint, and the run's totals written last.

A run directory belongs to one fingerprint (family, processor, checkpoint digests, dtypes,
versions). Reopening it with another is refused, naming what differs, so runs never mix.
"""

from __future__ import annotations

import hashlib
import json
import platform

from batchvlm.config import ConfigError, differences
from batchvlm.faults import crash_point
from batchvlm.format.schema import FORMAT_VERSION, check_format
from batchvlm.pipeline.preprocess import merged_stats
from batchvlm.rundir.dedup import bucket_results
from batchvlm.rundir.durable import durable_write, durable_write_json, read_json
from batchvlm.rundir.layout import RunLayout
from batchvlm.rundir.manifest import RunTotals
from batchvlm.rundir.upgrade import run_format, write_marker


def check_ours(layout: RunLayout) -> None:
    """The run directory is new, or a batchvlm run's of the current output format: the job never writes, nor cleans
    up, in a folder of someone else's files, nor adds to a run of another format."""
    if not layout.root.exists():
        return
    if (version := run_format(layout)) is not None:
        check_format(version, str(layout.root))
        return
    if found := sorted(path.name for path in layout.root.iterdir()):
        raise ConfigError(f"{layout.root} is not empty and not a batchvlm run directory (it holds "
                          f"{', '.join(found[:5])}{', ...' if len(found) > 5 else ''}); give the run an empty or new "
                          "folder: another run_name=... or output.root=...")


class RunDir:
    """A run directory opened for a job: `fingerprint` is what its outputs depend on (executor.fingerprint), and
    `config_yaml` the job's resolved config, kept from the launch that started the run."""

    def __init__(self, layout: RunLayout, fingerprint: dict, config_yaml: str, ranks):
        self.layout = layout
        self.path = layout.root
        # Round-trip through JSON so the comparison with a stored fingerprint sees the same types.
        self.fingerprint = json.loads(json.dumps(fingerprint, sort_keys=True))
        self.fingerprint_digest = hashlib.sha256(json.dumps(self.fingerprint, sort_keys=True).encode()).hexdigest()
        self.path.mkdir(parents=True, exist_ok=True)
        if ranks.is_main:
            self._claim(config_yaml)
        ranks.barrier()
        self._check_fingerprint()

    def _claim(self, config_yaml: str) -> None:
        """Rank 0 writes the marker, the fingerprint and the starting config of a new run directory."""
        self._check_fingerprint()
        if not self.layout.marker.exists():
            write_marker(self.layout)
        if not self.layout.fingerprint.exists():
            durable_write_json(self.layout.fingerprint, self.fingerprint)
        if not self.layout.config.exists():  # the config that started the run; restarts log theirs
            durable_write(self.layout.config, lambda tmp: tmp.write_text(config_yaml))

    def _check_fingerprint(self) -> None:
        existing = self.layout.fingerprint
        if existing.exists() and (previous := json.loads(existing.read_text())) != self.fingerprint:
            raise ConfigError(f"{self.path} was written with another fingerprint "
                              f"({differences(previous, self.fingerprint)}); "
                              "use another run_name=... for a new run, or delete the directory")

    def completed(self) -> dict | None:
        """The totals of a finished run, or None."""
        return read_json(self.layout.success)

    def finish(self, plan, seconds: float, records_seen: int, image_tokens: int) -> dict:
        """Rank 0, once every unit and duplicate bucket is committed: the run's totals (RunTotals), written last
        where the run is complete."""
        manifests = [manifest for manifest in plan.manifests(self.layout) if manifest is not None]
        buckets = bucket_results(self.layout, plan.dedup_buckets)
        totals = RunTotals.of(manifests, buckets)
        summary = {
            "run_dir": str(self.path),
            "units": len(plan.units), "units_committed": totals.units_committed,
            "records_in": totals.records_in, "written": totals.written, "quarantined": totals.quarantined,
            "by_check": totals.by_check,
            "duplicates": {"later_occurrences": totals.later_occurrences, "in_data": totals.duplicates_in_data},
            "files": totals.files, "bytes": totals.bytes,
            "complete": len(manifests) == len(plan.units) and all(buckets),
            "seconds": seconds,
            "records_per_s": records_seen / seconds if seconds else 0.0,
            "tokens_per_s": image_tokens / seconds if seconds else 0.0,
            # images redone on the CPU path, by check, and the parity sample, from every unit's manifest
            **merged_stats([manifest.preprocess for manifest in manifests]),
            "host": platform.node(),
            "format_version": FORMAT_VERSION,
            "checkpoint": self.fingerprint["checkpoint"],
            "family": self.fingerprint["family"],
        }
        if summary["complete"] and not self.layout.success.exists():
            crash_point("finish.before_success")
            durable_write_json(self.layout.success, summary)
        return summary
