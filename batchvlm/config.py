"""Config schemas: one dataclass per Hydra group, validated before any work starts.

Each YAML file under conf/ is merged onto these schemas, so an unknown key or a wrong type fails at
load with the key's name; value checks live in `__post_init__`, which runs when the composed config
becomes objects (`to_job_config`).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchvlm.checks import CATALOGUE

if TYPE_CHECKING:  # Hydra and OmegaConf are the jobs' (imported where the jobs use them): the library runs without
    from omegaconf import DictConfig


FLASH_ATTENTION = "flash_attention_2"


class ConfigError(ValueError):
    """A config value that cannot work. The message names the key."""


TINY = "tiny"
"""model.path of the family's tiny checkpoint, built on first use: the demo's, never a real model."""


def one_of(key: str, value: object, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not one of {', '.join(map(str, allowed))}")


def positive(key: str, value: int | float) -> None:
    if value <= 0:
        raise ConfigError(f"{key}={value!r} must be > 0")


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


@dataclass
class TextConfig:
    train_on: str = "auto"
    """Which tokens a trainer learns to predict (the stored loss_mask): assistant (the content and end-of-turn token of
    every assistant turn) | last_assistant (of the last one only) | all (every token but image tokens) | auto
    (assistant for a conversation; all for dataset.format=text, which has no turns)."""
    max_tokens: int | None = None
    """Tokens per record at most (the trainer's context length); null: no limit. A longer record is quarantined under
    text.too_long, or loses whole trailing turns (text.overflow)."""
    overflow: str = "quarantine"
    """A record over text.max_tokens: quarantine (text.too_long) | drop_turns (a conversation keeps its longest prefix
    of whole turns that ends with an assistant turn and fits; never part of an image; the row records how many
    turns it lost)."""

    def __post_init__(self) -> None:
        one_of("text.train_on", self.train_on, ("auto", "assistant", "last_assistant", "all"))
        one_of("text.overflow", self.overflow, ("quarantine", "drop_turns"))
        if self.max_tokens is not None:
            positive("text.max_tokens", self.max_tokens)
        if self.overflow == "drop_turns" and self.max_tokens is None:
            raise ConfigError("text.overflow=drop_turns needs text.max_tokens")

    def trained(self, format: str) -> str:
        """text.train_on resolved for a dataset format: auto trains assistant turns, or everything in plain text."""
        return ("all" if format == "text" else "assistant") if self.train_on == "auto" else self.train_on


@dataclass
class ModelConfig:
    family: str = "kimi_k25"
    """Encoder family module under batchvlm/families/."""
    path: str = TINY
    """Local checkpoint folder (safetensors), or `tiny`: the family's tiny demo checkpoint, built on first use. Required
    in a job's config: only the *_tiny model configs name `tiny` (the Python default is the demo's)."""
    tokenizer_path: str | None = None
    """Tokenizer folder when it is not the checkpoint's own."""
    dtype: str = "float32"
    """Compute dtype of the tower: float32 | bfloat16 | float16 (flash_attention_2 needs one of the last two)."""
    device: str = "auto"
    """auto (cuda when available, else cpu) | cpu | cuda | cuda:N."""
    attn_implementation: str = "sdpa"
    embedding: str = "auto"
    """Which output is stored as image_embeds: auto (the projector's LLM-ready tokens where the checkpoint has a
    projector, the tower's tokens otherwise) | projector | tower | both (projector tokens, plus the tower's in
    tower_embeds)."""
    framing: str = "k3"
    """kimi_k25 prompt contract: k3 (begin/content/end frame around each image's tokens) | plain (bare repeats, K2.5).
    Other families have one contract each and ignore it."""
    trust_remote_code: bool = False
    chat_template: str | None = None
    """A Jinja chat template file rendering conversations in place of the tokenizer's own (dataset.format other than
    text); each image must render as the family's single image token."""
    processor: dict[str, Any] = field(default_factory=dict)
    """Overrides of the checkpoint's processor parameters (family-specific keys, validated by the family)."""

    def __post_init__(self) -> None:
        if not self.path:
            raise ConfigError(f"model.path={self.path!r}: give a local checkpoint folder, or tiny for the demo's")
        one_of("model.dtype", self.dtype, ("float32", "bfloat16", "float16"))
        one_of("model.embedding", self.embedding, ("auto", "projector", "tower", "both"))
        one_of("model.framing", self.framing, ("k3", "plain"))
        one_of("model.attn_implementation", self.attn_implementation, ("sdpa", "eager", FLASH_ATTENTION))
        if self.attn_implementation == FLASH_ATTENTION and self.dtype == "float32":
            raise ConfigError(f"model.attn_implementation={FLASH_ATTENTION} runs in float16 or bfloat16 only, and "
                              "model.dtype=float32: set model.dtype=bfloat16 (or float16), or "
                              "model.attn_implementation=sdpa")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigError(f"model.device={self.device!r} is not one of auto, cpu, cuda, cuda:N")
        if self.chat_template is not None and not Path(self.chat_template).is_file():
            raise ConfigError(f"model.chat_template={self.chat_template!r} is not a file")


@dataclass
class DecodeConfig:
    formats: list[str] = field(default_factory=lambda: ["JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF"])
    """Pillow format names allowed, detected from the content, not the file name."""
    max_pixels: int = 50_000_000
    """Width x height limit, checked from the header before any pixel is allocated."""
    max_bytes: int = 64 * 1024 * 1024
    """Encoded size limit, checked before Pillow sees the bytes."""
    isolation: str = "process"
    """process: decode in a child process, so a decoder crash or hang costs one record; none: in-process."""
    timeout_s: float = 30.0
    """Per-image decode time limit (isolation=process)."""
    jpeg: str = "safe"
    """safe: every image decodes in the workers on the safe path | device: a JPEG that the batched decoder turns into
    the safe path's pixels has its header checked in the workers and is decoded in the main process, a packed batch's
    JPEGs in one torchvision call on the job's device (nvJPEG on CUDA, libjpeg-turbo on the CPU); every other image,
    and any the batched call fails on, on the safe path | auto: device when the job runs on CUDA, safe otherwise."""

    def __post_init__(self) -> None:
        one_of("decode.isolation", self.isolation, ("process", "none"))
        one_of("decode.jpeg", self.jpeg, ("safe", "auto", "device"))
        positive("decode.timeout_s", self.timeout_s)
        positive("decode.max_pixels", self.max_pixels)
        positive("decode.max_bytes", self.max_bytes)
        if not self.formats:
            raise ConfigError("decode.formats must name at least one format")


@dataclass
class PreprocessConfig:
    backend: str = "auto"
    """auto (triton on CUDA, torch otherwise) | triton (kernels/, fused, GPU) | torch (batchvlm's own ops, CPU or
    GPU) | reference (the family's Hugging Face processor)."""
    token_budget: int = 16384
    """Patches per packed batch; an image larger than the budget is encoded alone."""
    max_images_per_batch: int = 256
    background: str = "black"
    """Background that transparent pixels are composited onto: black | white | gray | chessboard."""
    fallback: str = "cpu"
    """An image whose backend result fails a preprocess check: cpu (redone on the CPU torch path, counted in the
    run's totals) | quarantine (its record is quarantined under the check)."""
    parity_sample_rate: float = 0.001
    """Fraction of images (chosen by content hash, so reruns pick the same) also run through the family's HF
    processor and compared with the backend (check preprocess.parity). The HF processor runs on the CPU."""
    parity_max_levels: float = 3.0
    """Largest pixel difference from the HF processor that parity accepts, in uint8 levels."""

    def __post_init__(self) -> None:
        one_of("preprocess.backend", self.backend, ("auto", "triton", "torch", "reference"))
        one_of("preprocess.fallback", self.fallback, ("cpu", "quarantine"))
        if not 0.0 <= self.parity_sample_rate <= 1.0:
            raise ConfigError(f"preprocess.parity_sample_rate={self.parity_sample_rate} must be in [0, 1]")
        positive("preprocess.parity_max_levels", self.parity_max_levels)
        one_of("preprocess.background", self.background, ("black", "white", "gray", "chessboard"))
        positive("preprocess.token_budget", self.token_budget)
        positive("preprocess.max_images_per_batch", self.max_images_per_batch)


@dataclass
class OutputConfig:
    root: str = "outputs"
    """Folder that holds run directories."""
    embed_dtype: str = "bfloat16"
    """dtype of stored embeddings (raw little-endian bytes): bfloat16 | float16 | float32."""
    compression: str = "zstd"
    quarantine_bytes_cap: int = 4 * 1024 * 1024
    """Original image bytes kept in a quarantine row up to this size; larger ones keep only their path."""
    shard_bytes: int = 1024 * 1024 * 1024
    """Bytes of a data or quarantine file at most, its footer included: a unit writes as many files as its rows need,
    all listed in its manifest, each a few row groups (of a quarter of this, 64 MB at most). A single record larger
    than that gets a file of its own."""

    def __post_init__(self) -> None:
        one_of("output.embed_dtype", self.embed_dtype, ("bfloat16", "float16", "float32"))
        positive("output.shard_bytes", self.shard_bytes)
        one_of("output.compression", self.compression, ("zstd", "snappy", "none"))
        if self.quarantine_bytes_cap < 0:
            raise ConfigError("output.quarantine_bytes_cap must be >= 0")


@dataclass
class ChecksConfig:
    max_quarantine_fraction: float = 0.5
    """Abort the job once this fraction of records is quarantined (after min_records)."""
    min_records: int = 100
    """Records seen before the quarantine fraction can abort the job."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.max_quarantine_fraction <= 1.0:
            raise ConfigError(f"checks.max_quarantine_fraction={self.max_quarantine_fraction} must be in [0, 1]")
        if self.min_records < 0:
            raise ConfigError("checks.min_records must be >= 0")


@dataclass
class RuntimeConfig:
    num_workers: int = 2
    """DataLoader worker processes for decode/plan/layout; 0 runs every stage inline (debugging)."""
    prefetch: int = 8
    """Records each worker keeps ready (bounds the worker-to-device queue)."""
    writer_queue: int = 16
    """Batches waiting for the writer thread (bounds the device-to-sink queue)."""
    progress: bool = True
    progress_interval_s: float = 30.0
    """Seconds between progress lines when stderr is not a terminal (Slurm, a redirect); a terminal gets a bar. Also
    how often a rank reports its count to rank 0, and rank 0 reads the others'."""
    lease_s: float = 120.0
    """A rank whose heartbeat is older than this loses the units it claimed: another rank takes them over."""
    poll_s: float = 2.0
    """How long a rank with nothing left to claim first waits before it looks at its launch's board again (for blocks
    of a dead rank, for the end); the wait doubles up to 8 times this, never beyond a quarter lease."""
    overlap: bool = True
    """Stage the next packed batch (host-to-device copies, preprocessing) while the current one encodes: on CUDA on a
    side stream, so copies and preprocessing overlap the tower; on the CPU the same order, without streams."""
    dedup_buckets: int | None = None
    """Hash partitions of the ids for the duplicate pass at the end (null: one per 2M planned records)."""
    block_units: int = 8
    """Work units a rank claims at once (a block, of consecutive units of the claim order), at most: fewer where the
    plan would give a rank of the launch that plans it under 8 blocks. Recorded in the plan."""

    def __post_init__(self) -> None:
        if self.num_workers < 0:
            raise ConfigError("runtime.num_workers must be >= 0")
        positive("runtime.prefetch", self.prefetch)
        positive("runtime.writer_queue", self.writer_queue)
        positive("runtime.progress_interval_s", self.progress_interval_s)
        positive("runtime.lease_s", self.lease_s)
        positive("runtime.poll_s", self.poll_s)
        if self.dedup_buckets is not None:
            positive("runtime.dedup_buckets", self.dedup_buckets)
        positive("runtime.block_units", self.block_units)


@dataclass
class JobConfig:
    run_name: str = "demo"
    """Run directory name under output.root; the same for every rank and every restart."""
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    preprocess: PreprocessConfig = field(default_factory=PreprocessConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    checks: ChecksConfig = field(default_factory=ChecksConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    text: TextConfig = field(default_factory=TextConfig)
    requeue_from: str | None = None
    """A run directory whose quarantined records alone are re-run, re-read from the current dataset with
    the current config; the default run_name is then `<that run's name>-requeue`."""
    check: Any = None
    """With requeue_from: only the records quarantined under these checks (a list, or names joined by commas)."""

    def __post_init__(self) -> None:
        if not self.run_name or "/" in self.run_name or self.run_name in (".", ".."):
            raise ConfigError(f"run_name={self.run_name!r} must be a plain folder name")
        self.check = _check_names(self.check)
        if self.dataset.format == "text" and self.text.trained("text") != "all":
            raise ConfigError(f"text.train_on={self.text.train_on}: dataset.format=text has no turns; its records "
                              "train on every token (text.train_on=all or auto)")
        if self.dataset.format == "text" and self.text.overflow == "drop_turns":
            raise ConfigError("text.overflow=drop_turns: dataset.format=text has no turns to drop; use quarantine")
        if self.check is not None and self.requeue_from is None:
            raise ConfigError("check=... selects quarantined records to requeue; it needs requeue_from=<run dir>")

    def reading_settings(self) -> dict:
        """Every setting that changes which rows a run reads or what they mean: the dataset's columns and rules, and
        the decode limits (not where the inputs are: their own identities stand for that). A resume under other
        values would give a run whose units read different records."""
        dataset = {key: value for key, value in dataclasses.asdict(self.dataset).items()
                   if key not in ("path", "storage_options")}
        return {"dataset": dataset, "decode": dataclasses.asdict(self.decode)}


@dataclass
class EstimateConfig(JobConfig):
    """`batchvlm-estimate`: the embed job's config, and how to size it."""

    records: int = 1000
    """Records sampled from the inputs, spread over the work units; their images' headers are read, not decoded."""
    images_per_s: float | None = None
    """Images per second one device embeds (measured with `batchvlm-bench task=e2e`, or a sample run): with it, the
    hours and the write bandwidth the job needs."""
    devices: int = 1
    """Devices the job runs on (GPUs over every node)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        positive("records", self.records)
        positive("devices", self.devices)
        if self.images_per_s is not None:
            positive("images_per_s", self.images_per_s)


def _check_names(value) -> list[str] | None:
    """`check=a,b` and `check=[a,b]` alike, each a name of the check catalogue."""
    if value is None:
        return None
    names = [name.strip() for name in (value.split(",") if isinstance(value, str) else value) if name.strip()]
    unknown = [name for name in names if name not in CATALOGUE]
    if unknown or not names:
        raise ConfigError(f"check={value!r}: {', '.join(unknown) or 'no check named'} is not a check "
                          f"(known: {', '.join(CATALOGUE)})")
    return names


def differences(old: dict, new: dict, prefix: str = "") -> str:
    """`key: old -> new` for every key whose value differs, nested keys dotted."""
    keys = sorted(set(old) | set(new))
    diffs = []
    for key in keys:
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            inner = differences(a, b, f"{prefix}{key}.")
            if inner:
                diffs.append(inner)
        elif a != b:
            diffs.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return "; ".join(diffs)


def default_run_name(requeue_from: str | None, default: str) -> str:
    """run_name's default: `<old run>-requeue` for a requeue, so it never writes into the run it reads."""
    return f"{Path(requeue_from).name}-requeue" if requeue_from else default


def register_schemas() -> None:
    """Register the job's schema (conf/embed.yaml names it first in its defaults list) and run_name's resolver.

    The groups need no entries of their own: JobConfig types every group's node, so each YAML merged onto
    it is checked key by key. A `schema` option per group would also show in `--help` and tab completion,
    and `model=schema` would run with the dataclass defaults."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import MISSING, OmegaConf

    OmegaConf.register_new_resolver("batchvlm.default_run_name", default_run_name, replace=True)
    for name, node in (("embed_schema", JobConfig), ("estimate_schema", EstimateConfig)):
        schema = OmegaConf.structured(node)
        # A job names its checkpoint: merged onto a default, a model YAML's `path: ???` would leave it standing.
        schema.model.path = MISSING
        ConfigStore.instance().store(name=name, node=schema)


def fail(message: str, status: int) -> None:
    """End a job with `status` and one line on stderr, not a traceback."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(status)


@contextmanager
def exit_on_config_error(*also: type[Exception]) -> Iterator[None]:
    """A job's bad config or argument (or an error of the kinds `also` names) ends it with exit 2 and the message that
    names the key, not a traceback."""
    try:
        yield
    except (ConfigError, *also) as error:
        fail(str(error), 2)


def required_path(cfg: DictConfig, key: str, usage: str) -> Path:
    """A `???` key that the user gives on the command line: a ConfigError that shows how, not a traceback."""
    from omegaconf import OmegaConf

    if OmegaConf.is_missing(cfg, key):
        raise ConfigError(f"{key} is required: {usage}")
    return Path(cfg[key])


def _reject_unknown_keys(node: DictConfig, schema: type, prefix: str = "") -> None:
    """Hydra's `+key=value` adds keys even to typed nodes; refuse them rather than ignore them."""
    fields = {f.name: f for f in dataclasses.fields(schema)}
    for key in node.keys():
        if key not in fields:
            raise ConfigError(f"{prefix}{key} is not a config key (known under {prefix.rstrip('.') or 'the root'}: "
                              f"{', '.join(fields)})")
        factory = fields[key].default_factory
        if isinstance(factory, type) and dataclasses.is_dataclass(factory):
            _reject_unknown_keys(node[key], factory, f"{prefix}{key}.")


def to_job_config(cfg: DictConfig, schema: type = JobConfig) -> JobConfig:
    """Turn the composed config into validated objects; ConfigError names the offending key."""
    _reject_unknown_keys(cfg, schema)
    from omegaconf import OmegaConf
    from omegaconf.errors import MissingMandatoryValue

    try:
        job = OmegaConf.to_object(cfg)
    except MissingMandatoryValue as error:
        key = error.full_key
        hint = (" (a local checkpoint folder; model=<family>_tiny for the demo's tiny checkpoint)"
                if key == "model.path" else "")
        raise ConfigError(f"{key} is required: give {key}=...{hint}") from None
    assert isinstance(job, schema)
    return job
