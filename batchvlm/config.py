"""What every config schema shares: the error that names a key, the value checks, and turning a composed Hydra config
into validated objects.

Each schema is a dataclass beside the code it configures (the dataset's in sources/config.py, the decoder's in
pipeline/decode.py, the job's in executor/config.py, ...). Each YAML file under conf/ is merged onto them, so an
unknown key or a wrong type fails at load with the key's name; value checks live in `__post_init__`, which runs when
the composed config becomes objects (`to_job_config`).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import re
import sys
import typing
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:  # Hydra and OmegaConf are the jobs' (imported where the jobs use them): the library runs without
    from omegaconf import DictConfig


class ConfigError(ValueError):
    """A config value that cannot work. The message names the key."""


class Choice(str, enum.Enum):
    """The values a config key may take. OmegaConf checks a value from a YAML file or the command line against them
    as it composes the config, naming the key (it rejects `Literal`); a value given in Python is checked by
    `Config.__post_init__`. A member is its value as a string too (`Dtype.float32 == "float32"`), so JSON, YAML
    and comparisons see the plain value. Members are named as their values."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class Effect(enum.Enum):
    """What a config field does to a run's output: every field of a run's config declares one (`written`,
    `read_from`, `operational`), and the run's fingerprint is computed from the declarations (`fingerprinted`)."""

    WRITTEN = "changes what is written or quarantined: its value is in the run's fingerprint"
    READ_FROM = ("names what is read (a checkpoint, a file, the inputs): their content is in the run's fingerprint or "
                 "plan (a digest, the inputs' identities), not the name, which may differ between nodes and launches")
    OPERATIONAL = "how the job runs, not what it writes: never in the fingerprint"


EFFECT = "batchvlm.effect"
"""The key of a config field's metadata that holds its Effect."""


def _declared(effect: Effect, default: Any, factory: Any) -> Any:
    return dataclasses.field(default=default, default_factory=factory, metadata={EFFECT: effect})


def written(default: Any = dataclasses.MISSING, *, factory: Any = dataclasses.MISSING) -> Any:
    """A config field that changes what a run writes or quarantines: a relaunch with another value would mix two
    outputs in one run, so its value is in the run's fingerprint."""
    return _declared(Effect.WRITTEN, default, factory)


def read_from(default: Any = dataclasses.MISSING, *, factory: Any = dataclasses.MISSING) -> Any:
    """A config field that names what is read, whose content (not its name) the fingerprint or the plan holds."""
    return _declared(Effect.READ_FROM, default, factory)


def operational(default: Any = dataclasses.MISSING, *, factory: Any = dataclasses.MISSING) -> Any:
    """A config field that changes how the job runs (speed, memory, where it logs), never what it writes."""
    return _declared(Effect.OPERATIONAL, default, factory)


def effect_of(field: dataclasses.Field, owner: type) -> Effect:
    """A field's declared Effect; a field that declares none is an error, so a new key cannot be left out."""
    if EFFECT not in field.metadata:
        raise TypeError(f"{owner.__name__}.{field.name} declares no Effect: declare it with written(...), "
                        "read_from(...) or operational(...) (batchvlm.config)")
    return field.metadata[EFFECT]


def declared(config: Any, prefix: str = "") -> dict[str, Effect]:
    """Every key of a config (and the configs it nests), dotted, and what it declares it does to the output."""
    found = {}
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if dataclasses.is_dataclass(value):
            found.update(declared(value, f"{prefix}{field.name}."))
        else:
            found[f"{prefix}{field.name}"] = effect_of(field, type(config))
    return found


def fingerprinted(config: Any) -> dict:
    """The values of the fields a config (and the configs it nests) declares `written`, nested as the config: what the
    settings contribute to a run's fingerprint."""
    found = {}
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if dataclasses.is_dataclass(value):
            if inner := fingerprinted(value):
                found[field.name] = inner
        elif effect_of(field, type(config)) is Effect.WRITTEN:
            found[field.name] = value.value if isinstance(value, enum.Enum) else value
    return found


class Config:
    """The base of every config schema: a key prefix for messages (`KEY`, e.g. "decode"), and each `Choice` field's
    value checked and made a member when the config is built in Python (OmegaConf does it for YAML)."""

    KEY: typing.ClassVar[str] = ""

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for field in dataclasses.fields(self):
            choices = _choice_type(hints.get(field.name))
            value = getattr(self, field.name)
            if choices is not None and value is not None and not isinstance(value, choices):
                try:
                    setattr(self, field.name, choices(value))
                except ValueError:
                    raise ConfigError(f"{self.key(field.name)}={value!r} is not one of "
                                      f"{', '.join(member.value for member in choices)}") from None

    def key(self, name: str) -> str:
        """The dotted key of one of this config's fields, as the user writes it."""
        return f"{self.KEY}.{name}" if self.KEY else name


def _choice_type(hint: Any) -> type[Choice] | None:
    """The Choice of a field typed `SomeChoice` or `SomeChoice | None`."""
    for candidate in typing.get_args(hint) or (hint,):
        if isinstance(candidate, type) and issubclass(candidate, Choice):
            return candidate
    return None


@dataclass(frozen=True)
class ByteLimit:
    """An encoded size limit: at most `bytes`, else the check `check` fails, naming the config key that sets it and
    what is read (an image, a clip)."""

    bytes: int
    check: str
    key: str
    what: str


def positive(key: str, value: int | float) -> None:
    if not math.isfinite(value):  # nan passes no limit check; inf overflows a wait or a sleep
        raise ConfigError(f"{key}={value!r} must be a finite number > 0")
    if value <= 0:
        raise ConfigError(f"{key}={value!r} must be > 0")


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


BRACE_PATTERN = re.compile(r"\{[^{}:'\"]*(\.\.|,)[^{}:'\"]*\}")
"""`{00000..00009}` or `{a,b}`: a brace pattern of dataset.path (a Hydra dictionary has colons)."""
QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"")


def check_command_line(arguments: list[str]) -> None:
    """What a shell did to the overrides before Hydra sees them: a brace pattern left unquoted is expanded by the shell
    into one argument per name (the same key again and again, of which Hydra would keep the last alone), or reaches
    Hydra bare (which reads braces as a dictionary). ConfigError naming the key and how to quote it."""
    given: dict[str, list[str]] = {}
    for argument in arguments:
        if argument.startswith("-") or "=" not in argument:
            continue
        key, value = argument.split("=", 1)
        key = key.lstrip("+~")
        given.setdefault(key, []).append(value)
        if BRACE_PATTERN.search(QUOTED.sub("", value)):
            raise ConfigError(f"{key}={value}: a brace pattern must reach Hydra quoted (bare, Hydra reads braces as a "
                              f"dictionary): \"{key}='{value}'\" (double quotes for the shell, single for Hydra)")
    for key, values in given.items():
        if len(values) > 1:
            shown = ", ".join(values[:3]) + (", ..." if len(values) > 3 else "")
            raise ConfigError(f"{key} is given {len(values)} times ({shown}): a shell expands a brace pattern left "
                              "unquoted into one argument per name, and Hydra would keep the last alone; quote the "
                              f"pattern: \"{key}='shards/{{00000..00009}}.tar'\" (double quotes for the shell, single "
                              "for Hydra)")


def job_main(config_name: str) -> Callable:
    """`hydra.main` over batchvlm's config `config_name`, its command line checked first (check_command_line): a job's
    entry point, as a console script calls it."""
    import hydra

    def decorate(function: Callable) -> Callable:
        run = hydra.main(config_path="pkg://batchvlm.conf", config_name=config_name, version_base=None)(function)

        @functools.wraps(function)
        def main() -> None:
            with exit_on_config_error():
                check_command_line(sys.argv[1:])
                check_overrides_compose(config_name, sys.argv[1:])
            run()

        return main

    return decorate


def check_overrides_compose(config_name: str, arguments: list[str]) -> None:
    """Compose the config with the command line's overrides before Hydra's own run does: a value its schema refuses
    (a choice not among an Enum's, a string for an int) becomes a ConfigError naming the key, so the job ends with
    exit 2 like every other refusal, before Hydra makes the run folder. A sweep (-m) is composed job by job by Hydra."""
    from hydra import compose, initialize_config_module
    from hydra.errors import HydraException
    from omegaconf import DictConfig
    from omegaconf.errors import OmegaConfBaseException

    if any(argument in ("-m", "--multirun") for argument in arguments):
        return
    overrides = [argument for argument in arguments if not argument.startswith("-") and "=" in argument]
    with initialize_config_module("batchvlm.conf", version_base=None):
        try:
            cfg = compose(config_name=config_name, overrides=overrides, return_hydra_config=True)
        except (HydraException, OmegaConfBaseException) as error:
            cause = error.__cause__ if isinstance(error.__cause__, OmegaConfBaseException) else error
            key = getattr(cause, "full_key", None)
            if not key:
                raise ConfigError(str(error).strip()) from None
            raise ConfigError(f"{key}: {str(cause).strip().splitlines()[0]}") from None
    try:
        root = cfg.output.root if isinstance(cfg.get("output"), DictConfig) else None
    except OmegaConfBaseException:  # an interpolation only Hydra's run resolves (${hydra:...}): its run checks it
        root = None
    if root:
        check_folder_can_be_made("output.root", Path(root))


def check_folder_can_be_made(key: str, folder: Path) -> None:
    """Hydra makes the run folder under `folder` before the job runs: a file on the way would be its traceback."""
    for parent in (folder, *folder.parents):
        if parent.exists():
            if not parent.is_dir():
                raise ConfigError(f"{key}={folder}: {parent} is a file, not a folder")
            return


def required_path(cfg: DictConfig, key: str, usage: str) -> Path:
    """A `???` key that the user gives on the command line: a ConfigError that shows how, not a traceback."""
    from omegaconf import OmegaConf

    if OmegaConf.is_missing(cfg, key):
        raise ConfigError(f"{key} is required: {usage}")
    if not str(cfg[key]).strip():  # Path("") is ".": the user's current folder, which they did not name
        raise ConfigError(f"{key} is empty: {usage}")
    return Path(cfg[key])


def _reject_unknown_keys(node: DictConfig, prefix: str = "") -> None:
    """Hydra's `+key=value` adds keys even to typed nodes; refuse them rather than ignore them. Each node is checked
    against its own schema (a dataset's is its kind's)."""
    from omegaconf import DictConfig, OmegaConf

    fields = [f.name for f in dataclasses.fields(OmegaConf.get_type(node))]
    for key in node.keys():
        if key not in fields:
            raise ConfigError(f"{prefix}{key} is not a config key (known under {prefix.rstrip('.') or 'the root'}: "
                              f"{', '.join(fields)})")
        child = node._get_node(key)
        if isinstance(child, DictConfig) and dataclasses.is_dataclass(OmegaConf.get_type(child)):
            _reject_unknown_keys(child, f"{prefix}{key}.")


Schema = TypeVar("Schema")


def to_job_config(cfg: DictConfig, schema: type[Schema]) -> Schema:
    """Turn the composed config into validated objects; ConfigError names the offending key."""
    _reject_unknown_keys(cfg)
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
