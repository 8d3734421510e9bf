"""What every config schema shares: the error that names a key, the value checks, and turning a composed Hydra config
into validated objects.

Each schema is a dataclass beside the code it configures (the dataset's in sources/config.py, the decoder's in
pipeline/decode.py, the job's in executor/config.py, ...). Each YAML file under conf/ is merged onto them, so an
unknown key or a wrong type fails at load with the key's name; value checks live in `__post_init__`, which runs when
the composed config becomes objects (`to_job_config`).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:  # Hydra and OmegaConf are the jobs' (imported where the jobs use them): the library runs without
    from omegaconf import DictConfig


class ConfigError(ValueError):
    """A config value that cannot work. The message names the key."""


def one_of(key: str, value: object, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not one of {', '.join(map(str, allowed))}")


def positive(key: str, value: int | float) -> None:
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


Schema = TypeVar("Schema")


def to_job_config(cfg: DictConfig, schema: type[Schema]) -> Schema:
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
