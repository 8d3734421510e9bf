"""The column types a dataset's columns must have to mean what the config says they hold."""

from __future__ import annotations

import pyarrow as pa

from batchvlm.config import ConfigError
from batchvlm.sources.config import DatasetConfig


def _texts(kind: pa.DataType) -> bool:
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_null(kind)


def _image(kind: pa.DataType) -> bool:
    """Bytes, a path, or an HF Image struct of them."""
    if pa.types.is_struct(kind):
        return any(kind.field(i).name in ("bytes", "path") for i in range(kind.num_fields))
    return pa.types.is_binary(kind) or pa.types.is_large_binary(kind) or _texts(kind)


def _images(kind: pa.DataType) -> bool:
    """One image, or a list of them."""
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return _image(kind.value_type)
    return _image(kind)


def _turns(kind: pa.DataType) -> bool:
    """A list of turn structs, or the list as a JSON string."""
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return pa.types.is_struct(kind.value_type)
    return _texts(kind)


COLUMN_TYPES = {"id_column": (lambda kind: _texts(kind) or pa.types.is_integer(kind), "a string or an integer"),
                "text_column": (_texts, "a string"), "status_column": (_texts, "a string"),
                "images_column": (_images, "image bytes, a path or an HF Image struct, or a list of them"),
                "videos_column": (_images, "clip bytes, a path or an HF Video struct, or a list of them")}
"""What each column the config names may hold: a value of any other type would mean something else or nothing."""
TURNS_COLUMN = (_turns, "a list of turns (structs) or a JSON string of one")
"""The text column of a conversation format (dataset.format other than text)."""


def check_column_types(schema: pa.Schema, cfg: DatasetConfig, where: str) -> None:
    """The columns the config names are of a type batchvlm reads as the config means them (ConfigError naming the
    key, the column and its type, before any row is read)."""
    kinds = COLUMN_TYPES if cfg.format == "text" else {**COLUMN_TYPES, "text_column": TURNS_COLUMN}
    for key, (accepts, wanted) in kinds.items():
        column = getattr(cfg, key)
        if column is not None and column in schema.names and not accepts(schema.field(column).type):
            raise ConfigError(f"dataset.{key}={column!r} is of type {schema.field(column).type} in {where}; "
                              f"it must hold {wanted}")
