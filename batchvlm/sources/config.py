"""The dataset's config, one schema per kind of input: what every source reads the same way (`DatasetConfig`: the
columns, the text format, the placeholder rules, the unit size), and what only some take (a path of files or of a
saved dataset, a split, a byte limit per unit). Each shipped YAML under conf/dataset/ names its kind's schema in
its defaults list, so a key the kind does not read (`dataset.split` of Parquet files) fails at load, naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from batchvlm.config import Choice, Config, ConfigError, operational, positive, read_from, written


class SourceKind(Choice):
    demo = "demo"
    parquet = "parquet"
    webdataset = "webdataset"
    json = "json"
    disk = "disk"
    imagefolder = "imagefolder"
    hub = "hub"


class TextFormat(Choice):
    """What a record's text column holds."""

    text = "text"
    llava = "llava"
    messages = "messages"
    cauldron = "cauldron"


class MissingIds(Choice):
    quarantine = "quarantine"
    content = "content"
    position = "position"


class MissingPlaceholder(Choice):
    prepend = "prepend"
    quarantine = "quarantine"


@dataclass
class DatasetConfig(Config):
    """What every kind of input reads the same way. A job's dataset is one of the kinds below (SCHEMAS), each of which
    sets `kind`; never this class itself."""

    KEY: ClassVar[str] = "dataset"

    kind: SourceKind | None = written(None)
    """demo | parquet | webdataset (tar shards) | json (JSON arrays or JSON Lines files) | disk (save_to_disk) |
    imagefolder | hub (a `datasets` hub dataset or local dataset folder, streamed). Set by the dataset's schema, which
    a YAML under conf/dataset/ names (`dataset=parquet`, ...): each kind has its own keys."""
    format: TextFormat = written(TextFormat.text)
    """What a record's text column holds: text (one string with a placeholder per image) | llava (LLaVA, ShareGPT4V,
    OneVision, Cambrian: `conversations` of {from, value}, `<image>` placeholders) | messages (HF / TRL: `messages`
    of {role, content}, content a string or {type: image} / {type: text, text} blocks) | cauldron (The Cauldron:
    `texts` of {user, assistant}, the images before the first user turn). dataset.text_column names the column."""
    image_first: bool = written(False)
    """llava: move a turn's lone placeholder to the front of its turn, followed by a newline, as LLaVA's own trainer
    does (which changes the text the model sees); off, every image stays exactly where the text puts it (Qwen's
    finetune scripts)."""
    storage_options: dict[str, Any] = read_from(factory=dict)
    """fsspec options of the input file system (e.g. {endpoint_url: ..., anon: true} for s3://), and of the image
    URLs read with dataset.fetch_urls."""
    id_column: str = written("id")
    """webdataset: `__key__` (the sample's key) or a field of its .json."""
    missing_ids: MissingIds = written(MissingIds.quarantine)
    """A record whose dataset.id_column is missing or empty (LLaMA-Factory's data has no id at all): quarantine
    (source.missing_id) | content (its id is `sha256:` and a digest of the record as the source reads it: the same
    wherever the record moves, a new one once the record itself is edited) | position (`<input>#<row>`: its place in
    its input, a byte offset in a JSON file; stable only while the input is not edited). In the run's fingerprint:
    the ids are the rows' identity."""
    images_column: str = written("images")
    """A column of image bytes / paths / HF Image structs, or a list of them per row. webdataset: the image
    part, `jpg;png;webp` meaning the first present."""
    text_column: str = written("text")
    videos_column: str | None = written(None)
    """A column of clips (paths under dataset.image_root, bytes, or {bytes, path} structs; or a list of them per row),
    each placed at a `<video>` in the record's text or turns; webdataset: the clip member, `mp4;webm;mkv` meaning the
    first present. Null: the format's own (llava `video`, messages `videos`); dataset.format=text then reads none. In
    the run's fingerprint only where set."""
    status_column: str | None = written(None)
    """A column (webdataset: a .json field) that must be `success` (img2dataset); other rows are quarantined
    under source.download_failed."""
    require_images: bool = written(False)
    """Quarantine a row without any image (source.missing_image) instead of writing it as text only."""
    image_root: str | None = read_from(None)
    """Folder that relative image paths are resolved against (default: the dataset file's folder). The images' own
    digests are in each row."""
    fetch_urls: bool = written(False)
    """Read images given as URLs (https://, s3://, ...) through fsspec; off, such an image is quarantined
    under decode.missing_file."""
    placeholder: str = written("<image>")
    """The dataset's image placeholder in text; the family expands it into its own tokens."""
    missing_placeholder: MissingPlaceholder = written(MissingPlaceholder.prepend)
    """A record with images but no placeholder at all: prepend the placeholders, or quarantine."""
    unit_records: int = operational(10_000)
    """Records per work unit at most (the unit of claiming, commit and resume: one shard of each kind)."""
    limit: int | None = written(None)
    """Read only the first N rows of each input file (for smoke runs)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if (own := kind_of(type(self))) is None:
            raise ConfigError("dataset: choose the kind of input with dataset=<name> (demo, parquet, webdataset, "
                              "llava, disk, imagefolder, hub, ...); a dataset YAML of your own extends one of those "
                              "(defaults: [parquet, _self_])")
        if self.kind != own:
            raise ConfigError(f"dataset.kind={self.kind}: this dataset's schema reads {own}; choose another kind with "
                              "dataset=<name>, not dataset.kind")
        if self.image_first and self.format != TextFormat.llava:
            raise ConfigError(f"dataset.image_first=true applies to dataset.format=llava, not {self.format}")
        positive("dataset.unit_records", self.unit_records)
        if not self.placeholder:
            raise ConfigError("dataset.placeholder must not be empty")
        for key in ("id_column", "images_column", "text_column", "status_column", "videos_column"):
            if getattr(self, key) is not None and not str(getattr(self, key)).strip():  # no row has such a column
                raise ConfigError(f"dataset.{key} must not be empty (null where a key allows none)")
        if self.limit is not None:
            positive("dataset.limit", self.limit)

    def described(self) -> str:
        """How a message names the dataset."""
        return f"dataset.kind={self.kind}"


def kind_of(schema: type[DatasetConfig]) -> SourceKind | None:
    """The kind a dataset schema reads: its `kind` field's default."""
    return schema.__dataclass_fields__["kind"].default


@dataclass
class CutByBytes(DatasetConfig):
    """Inputs whose units are also cut by their bytes (Parquet row groups, JSON records, saved datasets)."""

    unit_bytes: int = operational(256 * 1024 * 1024)
    """Input bytes per work unit at most (Parquet row groups: compressed)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        positive("dataset.unit_bytes", self.unit_bytes)


@dataclass
class DemoDataset(CutByBytes):
    """The embedded demo: real photographs with captions and a few deliberately bad records, in a Parquet file."""

    kind: SourceKind | None = written(SourceKind.demo)


@dataclass
class PathDataset(DatasetConfig):
    """An input at a path."""

    FILES: ClassVar[bool] = True
    """Whether the path names files (parquet, webdataset, json), and may be a list of them; else one dataset."""

    path: Any = read_from(None)
    """parquet / webdataset / json: a file, folder, glob or brace pattern (`shards/{00000..19999}.tar`, as img2dataset
    and webdataset name shard lists; quote it on the command line), or a list of them; local or an fsspec URL (s3://,
    gs://, hf://, file://). disk: a `save_to_disk` folder; imagefolder: the data dir; hub: the dataset's name or
    folder. The plan records each input's identity (size, modification time, ETag, a dataset's fingerprint)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.path:
            raise ConfigError(f"dataset.path is required for dataset.kind={self.kind}")
        if not (isinstance(self.path, str) or
                (isinstance(self.path, list) and all(isinstance(p, str) for p in self.path))):
            raise ConfigError(f"dataset.path={self.path!r} must be a path or a list of paths")
        if isinstance(self.path, list) and not self.FILES:
            raise ConfigError(f"dataset.path: a list of paths is for files (parquet, webdataset, json); dataset.kind="
                              f"{self.kind} reads one dataset")

    def described(self) -> str:
        return f"dataset.kind={self.kind}, dataset.path={self.path}"


@dataclass
class ParquetDataset(PathDataset, CutByBytes):
    kind: SourceKind | None = written(SourceKind.parquet)


@dataclass
class JsonDataset(PathDataset, CutByBytes):
    """JSON arrays (parsed a record at a time) or JSON Lines files."""

    kind: SourceKind | None = written(SourceKind.json)


@dataclass
class WebDatasetDataset(PathDataset):
    """WebDataset tar shards: a tar shard is always one work unit."""

    kind: SourceKind | None = written(SourceKind.webdataset)


@dataclass
class SplitDataset(PathDataset):
    """A `datasets` dataset: saved, an imagefolder, or on the hub."""

    FILES: ClassVar[bool] = False

    split: str = written("train")
    """Split to read where the dataset has several."""


@dataclass
class DiskDataset(SplitDataset, CutByBytes):
    """A folder written by `datasets`' save_to_disk."""

    kind: SourceKind | None = written(SourceKind.disk)


@dataclass
class ImageFolderDataset(SplitDataset, CutByBytes):
    """An imagefolder: images plus metadata.jsonl; without an id column, the first image's path is the key."""

    kind: SourceKind | None = written(SourceKind.imagefolder)


@dataclass
class HubDataset(SplitDataset):
    """A Hugging Face dataset (hub name or local dataset folder), streamed: one work unit per shard."""

    kind: SourceKind | None = written(SourceKind.hub)


SCHEMAS: dict[SourceKind, type[DatasetConfig]] = {kind_of(schema): schema for schema in (
    DemoDataset, ParquetDataset, JsonDataset, WebDatasetDataset, DiskDataset, ImageFolderDataset, HubDataset)}
"""Each kind's schema: the one a YAML under conf/dataset/ names in its defaults (`/dataset_schema/<kind>`)."""


def dataset_config(kind: str, **values) -> DatasetConfig:
    """The config of a dataset of `kind`, for code that builds a job in Python."""
    return SCHEMAS[SourceKind(kind)](**values)
