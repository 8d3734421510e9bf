"""The embed job's config: every group's schema composed, and registered for Hydra."""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from batchvlm.checks import CATALOGUE
from batchvlm.config import Config, ConfigError, operational, positive, read_from, written
from batchvlm.executor.tally import ChecksConfig
from batchvlm.families import ModelConfig
from batchvlm.pipeline.chat import Overflow, TextConfig, TrainOn
from batchvlm.pipeline.decode import DecodeConfig
from batchvlm.pipeline.preprocess import PreprocessConfig
from batchvlm.pipeline.video import VideoConfig
from batchvlm.rundir.claims import LEASE_S
from batchvlm.rundir.sink import OutputConfig
from batchvlm.sources.config import SCHEMAS, DatasetConfig, DemoDataset, TextFormat


@dataclass
class RuntimeConfig(Config):
    KEY: ClassVar[str] = "runtime"

    num_workers: int | None = operational(None)
    """DataLoader worker processes for decode/plan/layout; null: one per core of the rank (the node's cores shared by
    its ranks) but the main process's; 0 runs every stage inline (debugging)."""
    prefetch: int = operational(8)
    """Records a worker sends in one crossing at most, two crossings ready (bounds the worker-to-device queue)."""
    writer_queue: int = operational(16)
    """Batches waiting for the writer thread (bounds the device-to-sink queue)."""
    progress: bool = operational(True)
    progress_interval_s: float = operational(30.0)
    """Seconds between progress lines when stderr is not a terminal (Slurm, a redirect); a terminal gets a bar. Also
    how often a rank reports its count to rank 0, and rank 0 reads the others'."""
    lease_s: float = operational(LEASE_S)
    """A rank whose heartbeat is older than this loses the units it claimed: another rank takes them over."""
    poll_s: float = operational(2.0)
    """How long a rank with nothing left to claim first waits before it looks at its launch's board again (for blocks
    of a dead rank, for the end); the wait doubles up to 8 times this, never beyond a quarter lease."""
    overlap: bool = operational(True)
    """Stage the next packed batch (host-to-device copies, preprocessing) while the current one encodes: on CUDA on a
    side stream, so copies and preprocessing overlap the tower; on the CPU the same order, without streams."""
    dedup_buckets: int | None = operational(None)
    """Hash partitions of the ids for the duplicate pass at the end (null: one per 2M planned records)."""
    block_units: int = operational(8)
    """Work units a rank claims at once (a block, of consecutive units of the claim order), at most: fewer where the
    plan would give a rank of the launch that plans it under 8 blocks. Recorded in the plan."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_workers is not None and self.num_workers < 0:
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
class JobConfig(Config):
    """The embed job's config: a group per stage, and the job's own keys. Every field declares what it does to the
    output (batchvlm.config.Effect); the run's fingerprint holds the values of those that change it."""

    run_name: str = operational("demo")
    """Run directory name under output.root; the same for every rank and every restart."""
    dataset: DatasetConfig = field(default_factory=DemoDataset)
    model: ModelConfig = field(default_factory=ModelConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    video: VideoConfig = field(default_factory=VideoConfig)
    preprocess: PreprocessConfig = field(default_factory=PreprocessConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    checks: ChecksConfig = field(default_factory=ChecksConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    text: TextConfig = field(default_factory=TextConfig)
    requeue_from: str | None = read_from(None)
    """A run directory whose quarantined records alone are re-run, re-read from the current dataset with
    the current config; the default run_name is then `<that run's name>-requeue`."""
    check: Any = written(None)
    """With requeue_from: only the records quarantined under these checks (a list, or names joined by commas)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.run_name or "/" in self.run_name or self.run_name in (".", ".."):
            raise ConfigError(f"run_name={self.run_name!r} must be a plain folder name")
        self.check = _check_names(self.check)
        if self.dataset.format == TextFormat.text and self.text.trained("text") != TrainOn.all:
            raise ConfigError(f"text.train_on={self.text.train_on}: dataset.format=text has no turns; its records "
                              "train on every token (text.train_on=all or auto)")
        if self.dataset.format == TextFormat.text and self.text.overflow == Overflow.drop_turns:
            raise ConfigError("text.overflow=drop_turns: dataset.format=text has no turns to drop; use quarantine")
        if self.check is not None and self.requeue_from is None:
            raise ConfigError("check=... selects quarantined records to requeue; it needs requeue_from=<run dir>")

    def reading_settings(self) -> dict:
        """Every setting that changes which rows a run reads or what they mean: the dataset's columns and rules, and
        the decode limits (not where the inputs are: their own identities stand for that). A resume under other
        values would give a run whose units read different records."""
        dataset = {key: value for key, value in dataclasses.asdict(self.dataset).items()
                   if key not in ("path", "storage_options")}
        return json.loads(json.dumps({"dataset": dataset, "decode": dataclasses.asdict(self.decode)}))


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


def default_run_name(requeue_from: str | None, default: str) -> str:
    """run_name's default: `<old run>-requeue` for a requeue, so it never writes into the run it reads."""
    return f"{Path(requeue_from).name}-requeue" if requeue_from else default


def _demo_clips(name: str = "clips.json") -> str:
    """conf/dataset/demo_clips.yaml's path (demo_captioned_clips.yaml's with `captions.jsonl`): the demo's clip
    records, built on first use."""
    from batchvlm.demo import demo_clips

    return demo_clips(name)


@functools.cache  # once a process: the schema's structured config takes a tenth of a second to build
def register_schemas(name: str = "embed_schema", job: type[JobConfig] = JobConfig) -> None:
    """Register a job's schema under `name` (its YAML names it first in its defaults list: embed_schema, or the
    estimate's), each kind of dataset's schema under `dataset_schema/<kind>` (which a YAML under conf/dataset/ names in
    its own defaults), and the resolvers of run_name and the demo's clips.

    The other groups need no entries of their own: the job's schema types their nodes, so each YAML merged onto it is
    checked key by key. A `schema` option per group would also show in `--help` and tab completion, and
    `model=schema` would run with the dataclass defaults."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import MISSING, OmegaConf

    OmegaConf.register_new_resolver("batchvlm.default_run_name", default_run_name, replace=True)
    OmegaConf.register_new_resolver("batchvlm.demo_clips", _demo_clips, replace=True)
    store = ConfigStore.instance()
    for kind, dataset in SCHEMAS.items():
        store.store(group=DATASET_SCHEMA, name=str(kind), node=dataset)
    schema = OmegaConf.structured(job)
    # A job names its checkpoint: merged onto a default, a model YAML's `path: ???` would leave it standing.
    schema.model.path = MISSING
    # Typed as the base of every kind, so that the dataset YAML's kind (a subclass) merges onto it.
    schema.dataset = OmegaConf.structured(DatasetConfig)
    store.store(name=name, node=schema)


DATASET_SCHEMA = "dataset_schema"
"""The config group of the dataset kinds' schemas."""
