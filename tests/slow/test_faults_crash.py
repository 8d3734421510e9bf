"""A crash point exits with 137 on its n-th hit."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# a process of its own
pytestmark = pytest.mark.slow


HIT_THREE_TIMES = """
from batchvlm.faults import crash_point
for hit in range(1, 4):
    print(hit, flush=True)
    crash_point("commit.before_manifest")
"""


def test_a_crash_point_exits_with_137_on_its_nth_hit():
    env = {**os.environ, "BATCHVLM_FAULTS": "crash.commit.before_manifest=2"}
    result = subprocess.run([sys.executable, "-c", HIT_THREE_TIMES], env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 137 and result.stdout.split() == ["1", "2"]
