"""Strings as Parquet stores them: UTF-8, which a Python string cannot always be.

A record can hold code points UTF-8 has no bytes for: a lone surrogate (`"\\ud800"` is valid JSON), or a byte that was
not UTF-8, which batchvlm reads as Python's `surrogateescape` does (U+DC80..U+DCFF) so that the record survives to be
quarantined. Neither can be written to a Parquet string column; the quarantine stores them as backslash escapes
(`\\ud800`, `\\xff` for the raw byte), and the row's message says which fields it escaped.
"""

from __future__ import annotations

import re

SURROGATE = re.compile("[\ud800-\udfff]")


def encodable(text: str) -> bool:
    """Whether UTF-8 can encode the string (no surrogate code point in it)."""
    return text.isascii() or SURROGATE.search(text) is None


def _escape(match: re.Match) -> str:
    point = ord(match.group())
    return f"\\x{point - 0xDC00:02x}" if 0xDC80 <= point <= 0xDCFF else f"\\u{point:04x}"


def escaped(text: str) -> str:
    """The string with each code point UTF-8 cannot encode as a backslash escape: a byte read with surrogateescape as
    `\\xNN`, any other surrogate as `\\uXXXX`."""
    return text if encodable(text) else SURROGATE.sub(_escape, text)


def unencodable_fields(fields: dict[str, object]) -> list[str]:
    """The names of the fields that hold, anywhere in them (nested lists and objects, their keys too), a string UTF-8
    cannot encode."""
    return [name for name, value in fields.items() if not _all_encodable(value)]


def _all_encodable(value) -> bool:
    if isinstance(value, str):
        return encodable(value)
    if isinstance(value, dict):
        return all(_all_encodable(key) and _all_encodable(item) for key, item in value.items())
    if isinstance(value, (list, tuple)):
        return all(_all_encodable(item) for item in value)
    return True


def escaped_value(value):
    """The value with every string in it (nested lists and objects, their keys too) escaped."""
    if isinstance(value, str):
        return escaped(value)
    if isinstance(value, dict):
        return {escaped_value(key): escaped_value(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [escaped_value(item) for item in value]
    return value
