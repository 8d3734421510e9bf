"""The dataset's config: which inputs a job reads and how their rows become records."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from batchvlm.config import ConfigError, one_of, positive


FORMATS = ("text", "llava", "messages", "cauldron")
"""dataset.format: what a record's text column holds."""


@dataclass
class DatasetConfig:
    kind: str = "demo"
    """demo | parquet | webdataset (tar shards) | json (JSON arrays or JSON Lines files) | disk (save_to_disk) |
    imagefolder | hub (a `datasets` hub dataset or local dataset folder, streamed)."""
    path: Any = None
    """parquet / webdataset / json: a file, folder, glob or brace pattern (`shards/{00000..19999}.tar`, as img2dataset
    and webdataset name shard lists; quote it on the command line), or a list of them; local or an fsspec URL (s3://,
    gs://, hf://, file://). disk: a `save_to_disk` folder; imagefolder: the data dir; hub: the dataset's name or
    folder."""
    format: str = "text"
    """What a record's text column holds: text (one string with a placeholder per image) | llava (LLaVA, ShareGPT4V,
    OneVision, Cambrian: `conversations` of {from, value}, `<image>` placeholders) | messages (HF / TRL: `messages`
    of {role, content}, content a string or {type: image} / {type: text, text} blocks) | cauldron (The Cauldron:
    `texts` of {user, assistant}, the images before the first user turn). dataset.text_column names the column."""
    image_first: bool = False
    """llava: move a turn's lone placeholder to the front of its turn, followed by a newline, as LLaVA's own trainer
    does (which changes the text the model sees); off, every image stays exactly where the text puts it (Qwen's
    finetune scripts)."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """fsspec options of the input file system (e.g. {endpoint_url: ..., anon: true} for s3://)."""
    split: str = "train"
    """Split to read where the dataset has several (disk, imagefolder, hub)."""
    id_column: str = "id"
    """webdataset: `__key__` (the sample's key) or a field of its .json."""
    images_column: str = "images"
    """A column of image bytes / paths / HF Image structs, or a list of them per row. webdataset: the image
    part, `jpg;png;webp` meaning the first present."""
    text_column: str = "text"
    status_column: str | None = None
    """A column (webdataset: a .json field) that must be `success` (img2dataset); other rows are quarantined
    under source.download_failed."""
    require_images: bool = False
    """Quarantine a row without any image (source.missing_image) instead of writing it as text only."""
    image_root: str | None = None
    """Folder that relative image paths are resolved against (default: the dataset file's folder)."""
    fetch_urls: bool = False
    """Read images given as URLs (https://, s3://, ...) through fsspec; off, such an image is quarantined
    under decode.missing_file."""
    placeholder: str = "<image>"
    """The dataset's image placeholder in text; the family expands it into its own tokens."""
    missing_placeholder: str = "prepend"
    """A record with images but no placeholder at all: prepend the placeholders, or quarantine."""
    unit_records: int = 10_000
    """Records per work unit at most (the unit of claiming, commit and resume: one shard of each kind)."""
    unit_bytes: int = 256 * 1024 * 1024
    """Input bytes per work unit at most (Parquet row groups, compressed). A tar shard is always one unit."""
    limit: int | None = None
    """Read only the first N rows of each input file (for smoke runs)."""

    def __post_init__(self) -> None:
        one_of("dataset.kind", self.kind, ("demo", "parquet", "webdataset", "json", "disk", "imagefolder", "hub"))
        one_of("dataset.format", self.format, FORMATS)
        if self.image_first and self.format != "llava":
            raise ConfigError(f"dataset.image_first=true applies to dataset.format=llava, not {self.format}")
        one_of("dataset.missing_placeholder", self.missing_placeholder, ("prepend", "quarantine"))
        positive("dataset.unit_records", self.unit_records)
        positive("dataset.unit_bytes", self.unit_bytes)
        if self.kind != "demo" and not self.path:
            raise ConfigError(f"dataset.path is required for dataset.kind={self.kind}")
        if not (self.path is None or isinstance(self.path, str) or
                (isinstance(self.path, list) and all(isinstance(p, str) for p in self.path))):
            raise ConfigError(f"dataset.path={self.path!r} must be a path or a list of paths")
        if isinstance(self.path, list) and self.kind in ("disk", "imagefolder", "hub"):
            raise ConfigError(f"dataset.path: a list of paths is for files (parquet, webdataset); dataset.kind="
                              f"{self.kind} reads one dataset")
        if not self.placeholder:
            raise ConfigError("dataset.placeholder must not be empty")
        if self.limit is not None:
            positive("dataset.limit", self.limit)
