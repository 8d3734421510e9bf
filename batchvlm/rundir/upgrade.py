"""The output format of a run directory, and the one path that brings an older run up to the format this batchvlm
reads.

A run's marker (`.batchvlm`) names its format version, and so does every data and quarantine shard's schema metadata
(format.schema.FORMAT_KEY). Readers (the training readers, the report, verify, status, a requeue, the job itself)
refuse a run of another format with a message that says what to do: upgrade batchvlm for a newer one, upgrade the
run (`batchvlm-upgrade run_dir=...`) for an older one. Every difference of an older format is known here and
nowhere else, so no reader keeps a branch for it.

Format 1 (every run written before the format had a version) differs from format 2 in:
- the marker: absent (a run written before it), or without the version;
- the plan: no `block_units` (a plan made before blocks claims one unit per block);
- a manifest: one file per kind (an object) where format 2 lists the files of each kind;
- a data shard: no `num_tokens` (the length of `input_ids`), `loss_mask`, `turns` or `dropped_turns` column (a plain
  text's are null), no `huggingface` key for `datasets` (it follows from the batchvlm keys), `position_ids` a
  fixed-size list of three lists (which pyarrow before 26 cannot read back where it holds a null: format 2 stores a
  list of lists);
- a quarantine shard: no `turns` or `turn_index` column;
- a shard's schema metadata: no format version.

Format 2 (every run written before clips) differs from format 3 in its shards alone: a data shard has no clip columns
(`video_spans`, `video_grid_thw`, `second_per_grid_ts`, `video_num_tokens`, `video_frame_indices`,
`video_frame_times`, `video_embeds`), a quarantine shard no `video_index` or `video_paths`; the upgrade adds them, null
(no record of such a run holds a clip: it quarantined them as text.video).

Format 3 (every run written before Qwen3-VL and SigLIP2 clips) differs from format 4 in its data shards alone: no
`video_deepstack_embeds` or `video_pooled_embeds` column; the upgrade adds them, null (such a run quarantined those
families' clips as text.video).

The upgrade rewrites each listed shard of an older format (row group by row group, so a reader's row groups stay
where they were) beside itself and renames it into place, rewrites its unit's manifest with the new sizes and
digests, then the plan and the totals, and writes the marker last: the marker's version is the upgrade's commit. An
upgrade that stops part way is run again; a shard already in the new format is kept as it is.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

import batchvlm
from batchvlm.format.hf_features import SIZE_KEY, features_key
from batchvlm.format.schema import (DATA_SHARD, FORMAT_KEY, FORMAT_VERSION, QUARANTINE_SHARD, FormatError, Shard,
                                    check_format, format_of)
from batchvlm.rundir.durable import durable_write_json, publish, read_json, sha256_file, temporary_name
from batchvlm.rundir.layout import DATA, QUARANTINE, RunLayout
from batchvlm.rundir.manifest import DamagedFile, Listing, Manifest, RunTotals, checked

SHARDS = {DATA: DATA_SHARD, QUARANTINE: QUARANTINE_SHARD}


def run_format(layout: RunLayout) -> int | None:
    """The run's format version (1 for a run written before the format had one); None where the folder is not a
    batchvlm run directory (no marker, and not a run of before the marker; a file)."""
    if not layout.root.is_dir():
        return None
    marker = read_json(layout.marker)
    if marker is not None:
        return int(marker.get("format_version", 1))
    return 1 if layout.fingerprint.exists() and layout.plan.exists() else None


def check_run_format(layout: RunLayout) -> None:
    """FormatError unless the run is written in the format this batchvlm reads (a folder that is no run passes: the
    caller finds what it lacks)."""
    if (version := run_format(layout)) is not None:
        check_format(version, str(layout.root))


def write_marker(layout: RunLayout) -> None:
    """The marker of a run in the current format: written first by a new run, last by an upgrade."""
    durable_write_json(layout.marker, {"batchvlm": batchvlm.__version__, "run": layout.root.name,
                                       "format_version": FORMAT_VERSION})


@dataclass
class Upgraded:
    """What an upgrade did: the format it found, and the files it rewrote."""

    run_dir: Path
    found: int
    manifests: int = 0
    shards: int = 0


def upgrade_run(run_dir: Path) -> Upgraded:
    """Bring a run directory of an older format to the current one (see the module); nothing to do for a run in the
    current format; FormatError for a newer one, or a folder that is no run."""
    layout = RunLayout(Path(run_dir))
    found = run_format(layout)
    if found is None:
        raise FormatError(f"{run_dir} is not a batchvlm run directory (no {layout.name_of(layout.marker)})")
    if found > FORMAT_VERSION:
        check_format(found, str(run_dir))
    done = Upgraded(layout.root, found)
    if found == FORMAT_VERSION:
        return done
    manifests = []
    for path in sorted(layout.manifests.glob("*.json")) if layout.manifests.is_dir() else []:
        manifest, rewritten = _upgraded_manifest(layout, path)
        durable_write_json(path, manifest.to_json())
        manifests.append(manifest)
        done.manifests += 1
        done.shards += rewritten
    _upgrade_plan(layout)
    _upgrade_totals(layout, manifests)
    write_marker(layout)
    return done


def _upgraded_manifest(layout: RunLayout, path: Path) -> tuple[Manifest, int]:
    """A unit's manifest in the current format, its shards rewritten where they are not (and each checked against
    the manifest first: a damaged file is not rewritten into a new one that looks whole)."""
    raw = json.loads(path.read_text())
    # format 1 named one file per kind (an object) before units had several
    raw["files"] = {kind: [files] if isinstance(files, dict) else files for kind, files in raw["files"].items()}
    manifest = Manifest.from_json(raw, path)
    rewritten = 0
    files = {}
    for kind, listings in manifest.files.items():
        files[kind] = []
        for listing in listings:
            shard = layout.listed(listing.path)
            if kind in SHARDS and format_of(pq.read_schema(shard).metadata) < FORMAT_VERSION:
                _rewrite(checked(layout, listing), SHARDS[kind])
                rewritten += 1
            elif kind in SHARDS and not shard.exists():
                raise DamagedFile(f"{shard} is missing; its manifest lists it")
            files[kind].append(_listed_as_it_is(listing, shard) if kind in SHARDS else listing)
    return Manifest(**{**raw, "files": files}), rewritten


def _listed_as_it_is(listing: Listing, shard: Path) -> Listing:
    """The listing of a shard as it is now: a rewritten one has grown (its new columns and metadata)."""
    size = shard.stat().st_size
    return listing if size == listing.bytes else dataclasses.replace(listing, bytes=size, sha256=sha256_file(shard))


def _rewrite(path: Path, shard: Shard) -> None:
    """The shard in the current format, row group by row group, renamed over the old one."""
    file = pq.ParquetFile(path)
    metadata = upgraded_metadata(file.schema_arrow)
    schema = shard.schema.with_metadata(metadata)
    tmp = temporary_name(path)
    with pq.ParquetWriter(tmp, schema, compression=compression_of(file)) as writer:
        for group in range(file.num_row_groups):
            writer.write_table(conformed(file.read_row_group(group), shard).replace_schema_metadata(metadata))
    publish(tmp, path)


def compression_of(file: pq.ParquetFile) -> str:
    """The codec a shard was written with (output.compression), as ParquetWriter takes it: a rewrite keeps it."""
    compression = file.metadata.row_group(0).column(0).compression if file.metadata.num_row_groups else "ZSTD"
    return "none" if compression == "UNCOMPRESSED" else compression.lower()


def conformed(table: pa.Table, shard: Shard) -> pa.Table:
    """A table of an older shard in the declared columns: a column it lacks made (num_tokens from input_ids) or null,
    every column cast to its declared type."""
    columns = []
    for column in shard.columns:
        if column.name in table.column_names:
            values = table.column(column.name)
        elif column.name == "num_tokens":
            values = pc.list_value_length(table.column("input_ids")).cast(pa.int32())
        else:
            values = pa.nulls(len(table), column.type)
        columns.append(values.cast(column.type))
    return pa.Table.from_arrays(columns, schema=shard.schema)


def upgraded_metadata(schema: pa.Schema) -> dict:
    """An older shard's schema metadata with the format version, and the `datasets` key where it lacked one (from
    the batchvlm keys it has: each embedding column's dtype and hidden size)."""
    metadata = {key.decode(): value.decode() for key, value in (schema.metadata or {}).items()}
    if "huggingface" not in metadata and "batchvlm.embed_dtype" in metadata:
        sizes = {key.removeprefix(SIZE_KEY): int(value) for key, value in metadata.items() if key.startswith(SIZE_KEY)}
        metadata["huggingface"] = features_key(sizes, metadata["batchvlm.embed_dtype"])
    return {**metadata, FORMAT_KEY: str(FORMAT_VERSION)}


def _upgrade_plan(layout: RunLayout) -> None:
    raw = read_json(layout.plan)
    if raw is not None and "block_units" not in raw:
        durable_write_json(layout.plan, {**raw, "block_units": 1})  # a plan made before blocks: one unit each


def _upgrade_totals(layout: RunLayout, manifests: list[Manifest]) -> None:
    """A finished run's totals: its files' bytes as they are now, and the format."""
    summary = read_json(layout.success)
    if summary is None:
        return
    totals = RunTotals.of(manifests, [])
    durable_write_json(layout.success, {**summary, "files": totals.files, "bytes": totals.bytes,
                                        "format_version": FORMAT_VERSION})
