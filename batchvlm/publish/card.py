"""A run's dataset card (the repo's README.md): every fact read from the run directory, none typed by hand.

The YAML header lists the data files explicitly under `configs:` (never a glob: the Hub's `data/` could hold a file
that no push of this run wrote), with the license and the Hub's search metadata. The body says what the features
are (family, what `image_embeds` holds, hidden sizes and the byte layout), which tower made them (the checkpoint, its
revision where its download left one, the digests of its config and vision weights, the processor's parameters), how
many records were written and quarantined by check, the source dataset, the versions, and that the features are valid
only for this exact tower. The features themselves need no `dataset_info` in the header: every shard carries them in
its `huggingface` schema-metadata key (format/hf_features.py), which `load_dataset` reads; a copy in the card would be
a second source that could disagree.

The card depends on nothing but the run and the push's config (no date, no host), so a second push of an unchanged
run writes the same bytes and commits nothing.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import yaml

from batchvlm.families import TINY
from batchvlm.format.hf_features import SIZE_KEY
from batchvlm.rundir.durable import read_json
from batchvlm.rundir.layout import RunLayout

WHAT_IS_STORED = {
    "kimi_k25": "the MoonViT tower's tokens after the projector (patch merge + MLP): LLM-ready, one row per image "
                "token of `input_ids`",
    "qwen2_vl": "the vision tower's merger tokens (2x2 patch merge + MLP): LLM-ready, one row per image token of "
                "`input_ids`",
    "siglip2": "SigLIP2's patch tokens (no projector: the VLM's own projector maps them), one row per image token "
               "of `input_ids`",
}
"""What `image_embeds` holds for each shipped family with `model.embedding=auto`."""
EMBEDDING_CHOICES = {
    "tower": "the tower's tokens before the projector (model.embedding=tower)",
    "projector": "the projector's LLM-ready tokens (model.embedding=projector)",
    "both": "the projector's LLM-ready tokens; the tower's tokens before it are in `tower_embeds` "
            "(model.embedding=both)",
}
DOWNLOAD_METADATA = Path(".cache") / "huggingface" / "download" / "config.json.metadata"
"""What `huggingface-cli download --local-dir` leaves beside a checkpoint's config.json: its first line is the
commit the file was downloaded at."""


@dataclass(frozen=True)
class RunFacts:
    """What a card says of a run, as the run directory holds it."""

    run_name: str
    fingerprint: dict
    config: dict  # config.yaml, as the job wrote it
    totals: dict  # the totals the run wrote last (RunLayout.success)
    embedding_columns: dict[str, int]  # column -> hidden size, from a data shard's schema metadata
    revision: str | None  # the checkpoint's commit on the Hub, where its download recorded one
    clip_rows: int | None = None  # rows holding clips; None: the run's format names no clips (no clip rule)
    requeue_from: str | None = None  # a requeue run: the run whose quarantined records it read again

    @classmethod
    def of(cls, layout: RunLayout, footers: list[pq.FileMetaData]) -> RunFacts:
        """`footers`: the Parquet footers of the published data shards (a push reads each once), which give the
        embedding columns and count the rows with clips."""
        config = yaml.safe_load(layout.config.read_text())
        fingerprint = read_json(layout.fingerprint) or {}
        return cls(run_name=layout.root.name, fingerprint=fingerprint, config=config,
                   totals=read_json(layout.success) or {}, embedding_columns=embedding_columns(footers[0]),
                   revision=checkpoint_revision(config["model"]["path"], fingerprint.get("model_config_sha256")),
                   clip_rows=rows_with_clips(footers) if CLIP_RULE in fingerprint else None,
                   requeue_from=requeue_origin(layout))


def requeue_origin(layout: RunLayout) -> str | None:
    """The run a requeue run read its records from (its lineage.json, which `requeue_from=` writes); None otherwise."""
    lineage = read_json(layout.lineage)
    return str(lineage["requeue_from"]) if isinstance(lineage, dict) and lineage.get("requeue_from") else None


CLIP_RULE = "video_rule"
"""The fingerprint's key for the family's clip rule, there only where the run's dataset format can name clips."""


def rows_with_clips(footers: list[pq.FileMetaData]) -> int:
    """Rows whose video_embeds is set, from the shards' footers alone (each row group's null count of the column)."""
    rows = 0
    for metadata in footers:
        # The footer numbers leaf columns: a struct or nested list before video_embeds makes them more than the fields.
        column = next((i for i in range(metadata.num_columns) if metadata.schema.column(i).path == "video_embeds"),
                      None)
        for group in range(metadata.num_row_groups):
            chunk = metadata.row_group(group)
            rows += chunk.num_rows - (chunk.column(column).statistics.null_count if column is not None
                                      else chunk.num_rows)
    return rows


def embedding_columns(footer: pq.FileMetaData) -> dict[str, int]:
    """Each embedding column a shard holds and its hidden size (format.schema writes one key per column)."""
    metadata = footer.metadata or {}
    prefix = SIZE_KEY.encode()
    return {key[len(prefix):].decode(): int(value) for key, value in metadata.items() if key.startswith(prefix)}


def checkpoint_revision(model_path: str, config_sha256: str | None) -> str | None:
    """The commit the checkpoint was downloaded at, where `huggingface-cli download --local-dir` recorded it and the
    folder's config.json is still the one the run read (its digest is the fingerprint's); None otherwise."""
    if model_path == TINY:
        return None
    folder = Path(model_path)
    try:
        revision = (folder / DOWNLOAD_METADATA).read_text().splitlines()[0].strip()
        config = (folder / "config.json").read_bytes()
    except (OSError, IndexError):
        return None
    return revision if hashlib.sha256(config).hexdigest() == config_sha256 else None


SIZE_CATEGORIES = ((10 ** 3, "n<1K"), (10 ** 4, "1K<n<10K"), (10 ** 5, "10K<n<100K"), (10 ** 6, "100K<n<1M"),
                   (10 ** 7, "1M<n<10M"), (10 ** 8, "10M<n<100M"), (10 ** 9, "100M<n<1B"), (10 ** 10, "1B<n<10B"),
                   (10 ** 11, "10B<n<100B"), (10 ** 12, "100B<n<1T"))
"""The Hub's `size_categories` buckets, by their exclusive upper bound in rows."""


def size_category(rows: int) -> str:
    return next((name for bound, name in SIZE_CATEGORIES if rows < bound), "n>1T")


def card_header(facts: RunFacts, data_files: list[str], license: str) -> dict:
    family = facts.fingerprint["family"]
    return {
        "license": license,
        "pretty_name": f"{facts.run_name}: {family} vision features",
        "tags": ["batchvlm", "vision-features", "embeddings", family, *(["video"] if facts.clip_rows else [])],
        "size_categories": [size_category(facts.totals["written"])],
        "configs": [{"config_name": "default", "data_files": [{"split": "train", "path": list(data_files)}]}],
    }


def stored_as(facts: RunFacts) -> str:
    family, embedding = facts.fingerprint["family"], facts.fingerprint.get("embedding", "auto")
    if embedding in EMBEDDING_CHOICES:
        return EMBEDDING_CHOICES[embedding]
    return WHAT_IS_STORED.get(family, f"the {family} family's image features (model.embedding={embedding})")


def _checkpoint_lines(facts: RunFacts) -> list[str]:
    fingerprint, model = facts.fingerprint, facts.config["model"]
    if model["path"] == TINY:
        checkpoint = "the family's **tiny demo checkpoint** (random weights built from a config): not a real model"
    else:
        checkpoint = f"`{Path(model['path']).name}` (a local folder when the run read it)"
    revision = f"`{facts.revision}`" if facts.revision else (
        "not recorded (the folder was not downloaded with `huggingface-cli download --local-dir`, or its config.json "
        "changed since): the digests below identify it")
    return [
        f"- checkpoint: {checkpoint}",
        f"- revision: {revision}",
        f"- config.json sha256: `{fingerprint.get('model_config_sha256') or 'none'}`",
        f"- vision weights sha256 (the tensors the tower ran with): `{fingerprint.get('weights_sha256')}`",
        f"- tokenizer digest: `{fingerprint.get('tokenizer')}`"
        + (f"; chat template sha256 `{fingerprint['chat_template_sha256']}`"
           if fingerprint.get("chat_template_sha256") else ""),
        f"- processor parameters: `{json.dumps(fingerprint.get('processor', {}), sort_keys=True)}`",
        f"- tower dtype: `{model['dtype']}`, attention: `{model['attn_implementation']}`; JPEG decoder: "
        f"{fingerprint.get('jpeg_decoder')}",
    ]


def _feature_lines(facts: RunFacts) -> list[str]:
    dtype = facts.config["output"]["embed_dtype"]
    columns = ", ".join(f"`{name}` [rows, {size}]" for name, size in sorted(facts.embedding_columns.items()))
    family, version = facts.fingerprint["family"], facts.fingerprint.get("version")
    return [
        f"- family: `{family}`" + (f" (`{version}`)" if version not in (None, family) else ""),
        f"- `image_embeds`: {stored_as(facts)}",
        f"- hidden size: {facts.fingerprint.get('hidden_size')}; embedding columns: {columns}",
        f"- layout: each embedding cell is raw little-endian `{dtype}` bytes of a row-major [rows, hidden] matrix "
        f"(`large_binary`; bfloat16 has no numpy dtype: view the bytes as int16, then as torch.bfloat16); each "
        "column's dtype and hidden size are also in the shards' `huggingface` schema metadata "
        "(`Value(\"large_binary\", id=\"batchvlm:embed:<dtype>:<hidden>\")`)",
        *_clip_lines(facts),
    ]


def _clip_lines(facts: RunFacts) -> list[str]:
    if facts.clip_rows is None:
        return []
    rule = facts.fingerprint[CLIP_RULE]
    return [
        f"- clips: {facts.clip_rows:,} of the {facts.totals.get('written', 0):,} rows hold clips. `video_embeds` "
        f"[rows, {facts.embedding_columns.get('image_embeds')}] holds their merger tokens, one row per "
        "`<|video_pad|>` token, placed by `video_spans` (null on a row without clips); `video_grid_thw`, "
        "`second_per_grid_ts`, `video_num_tokens`, `video_frame_indices` and `video_frame_times` describe each clip",
        f"- clip rule: {rule.get('rule')}; parameters `{json.dumps(rule.get('params', {}), sort_keys=True)}`; "
        f"tokens_per_second {rule.get('tokens_per_second')}; positions: {rule.get('positions')}",
    ]


def _count_lines(facts: RunFacts) -> list[str]:
    totals = facts.totals
    lines = [f"- records read: {totals['records_in']:,}; written (rows of this dataset): {totals['written']:,}; "
             f"quarantined: {totals['quarantined']:,} (not published)"]
    lines += [f"  - `{check}`: {count:,}" for check, count in sorted(totals.get("by_check", {}).items())]
    if facts.requeue_from:
        lines.append(f"- a requeue run of `{Path(facts.requeue_from).name}` (`{facts.requeue_from}`): it holds only "
                     "the records read again from that run's quarantine; that run's own rows are not in this dataset")
    if moved := totals.get("duplicates", {}).get("in_data", 0):
        lines.append(f"- {moved:,} of the quarantined are later occurrences of an id already written (the run's "
                     "duplicate pass found them after their shards were committed): the shards holding them are "
                     "published without them, so their bytes differ from the run's files of the same name")
    return lines


def _source_lines(facts: RunFacts, license: str) -> list[str]:
    dataset = facts.config["dataset"]
    path = dataset.get("path")
    where = f", `{path}`" if path else ""
    return [f"- source dataset: `{dataset['kind']}`{where} ({dataset.get('format', 'text')} records)",
            f"- license: `{license}`, as given to the push: the features derive from the source's images and texts, "
            "whose own license applies to them too"]


def _version_lines(facts: RunFacts) -> list[str]:
    versions = facts.fingerprint.get("versions", {})
    return [f"- {', '.join(f'{name} {version}' for name, version in sorted(versions.items()))}; output format "
            f"{facts.totals.get('format_version')}"]


def dataset_card(facts: RunFacts, data_files: list[str], license: str) -> str:
    """The README.md of the dataset repo: the header, then the facts, all from the run."""
    header = yaml.safe_dump(card_header(facts, data_files, license), sort_keys=False, allow_unicode=True)
    family = facts.fingerprint["family"]
    sections = [
        f"# {facts.run_name}: precomputed {family} vision features",
        "Image features computed once by batchvlm from a source dataset, to train a VLM "
        "without running its vision tower: each row is one record, its token ids with the image tokens expanded, "
        "the image features for those tokens and the grids and spans that place them.",
        "## Features", *_feature_lines(facts),
        "## The tower these features belong to", *_checkpoint_lines(facts),
        "## Records", *_count_lines(facts),
        "## Source and license", *_source_lines(facts, license),
        "## Uses",
        "Direct: training the VLM whose vision tower is the one above with these features in place of its pixels "
        "(`datasets.load_dataset` gives the rows; `batchvlm.training.DatasetRows` turns one into tensors).",
        "### Out-of-scope use",
        "**These features are valid only for this exact tower**: the checkpoint and revision above, its vision "
        "weights (the sha256 above) and these processor parameters. Another checkpoint, revision, fine-tune, "
        "resolution setting or dtype gives other features: training or serving any other model on them "
        "silently degrades it.",
        "## Versions", *_version_lines(facts),
        f"## Data files\n\n{len(data_files):,} Parquet files, listed in the header above in read order.",
    ]
    return f"---\n{header}---\n\n" + "\n\n".join(_paragraphs(sections)) + "\n"


def _paragraphs(sections: list[str]) -> list[str]:
    """Consecutive list lines joined into one block, everything else its own paragraph."""
    blocks: list[str] = []
    for line in sections:
        if line.lstrip().startswith("- ") and blocks and blocks[-1].lstrip().startswith("- "):
            blocks[-1] += "\n" + line
        else:
            blocks.append(line)
    return blocks
