"""Fault points for crash-safety tests: `BATCHVLM_FAULTS="point=value,point=value"`.

Production code calls `fault(point)` or `crash_point(point)` at the few places a test must be able
to break; with the variable unset (always, outside tests) they return at once.

- `decode.crash=<sha256 prefix>` / `decode.hang=<sha256 prefix>`: the decoder child aborts / hangs on that image.
- `preprocess.wrong_grid=<sha256 prefix>`: the preprocessing backend pads that image one merge window too
  wide, so it produces a wrong grid (the CPU fallback path is not affected).
- `preprocess.wrong_clip=<record id>`: the backend's rows of that record's clips come back one row short.
- `crash.<point>=<n>`: the process exits with status 137 (as if SIGKILLed) the n-th time it reaches <point>.
- `disk_full.<point>=<n>`: writing at <point> fails as on a full disk (ENOSPC) from its n-th time on.
- `pause.<point>=<seconds>`: the process waits there, holding whatever it holds (a commit half done, a claim).
"""

from __future__ import annotations

import errno
import os
import time
from collections import Counter

_hits: Counter = Counter()


def _parse(spec: str) -> dict[str, str]:
    pairs = (item.split("=", 1) for item in spec.split(",") if item.strip())
    return {key.strip(): value.strip() for key, value in pairs}


def fault(point: str) -> str | None:
    spec = os.environ.get("BATCHVLM_FAULTS")
    return _parse(spec).get(point) if spec else None


def crash_point(point: str) -> None:
    if (seconds := fault(f"pause.{point}")) is not None:
        time.sleep(float(seconds))
    target = fault(f"crash.{point}")
    if target is None:
        return
    _hits[point] += 1
    if _hits[point] == int(target):
        os._exit(137)


def disk_full_point(point: str, path) -> None:
    """Raise what a write raises on a full disk, at <point>, from the n-th time on (`disk_full.<point>=<n>`)."""
    target = fault(f"disk_full.{point}")
    if target is None:
        return
    _hits[f"disk_full.{point}"] += 1
    if _hits[f"disk_full.{point}"] >= int(target):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
