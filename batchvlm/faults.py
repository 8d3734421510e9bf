"""Fault points for crash-safety tests: `BATCHVLM_FAULTS="point=value,point=value"`.

Production code calls `fault(point)` at the few places a test must be able to break; with the
variable unset (always, outside tests) it returns None and costs a dict lookup.
"""

from __future__ import annotations

import os


def _parse(spec: str) -> dict[str, str]:
    pairs = (item.split("=", 1) for item in spec.split(",") if item.strip())
    return {key.strip(): value.strip() for key, value in pairs}


def fault(point: str) -> str | None:
    return _parse(os.environ.get("BATCHVLM_FAULTS", "")).get(point)
