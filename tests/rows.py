"""Whole rows of the output contract for tests that write shards by hand: every declared column, a plain empty value
in each that every record writes, null in the others, and the values a test gives (which must be declared)."""

from __future__ import annotations

import pyarrow as pa

from batchvlm.format.schema import DATA_SHARD, FORMAT_KEY, FORMAT_VERSION, QUARANTINE_SHARD, Shard


def _empty(kind: pa.DataType):
    if pa.types.is_list(kind) or pa.types.is_fixed_size_list(kind):
        return []
    if pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
        return b""
    return "" if pa.types.is_string(kind) else 0


def whole_row(shard: Shard, **values) -> dict:
    assert values.keys() <= shard.names, values.keys() - shard.names
    return {column.name: _empty(column.type) if column.required else None for column in shard.columns} | values


def data_row(**values) -> dict:
    return whole_row(DATA_SHARD, **values)


def quarantine_row(**values) -> dict:
    return whole_row(QUARANTINE_SHARD, **values)


CURRENT_FORMAT = {FORMAT_KEY.encode(): str(FORMAT_VERSION).encode()}
"""The schema metadata a shard written in the current output format carries, at least."""
