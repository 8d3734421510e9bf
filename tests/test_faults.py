"""Fault points: off unless BATCHVLM_FAULTS names them; a crash point exits as a SIGKILL would, on the n-th hit."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from batchvlm.faults import crash_point, fault

HIT_THREE_TIMES = """
from batchvlm.faults import crash_point
for hit in range(1, 4):
    print(hit, flush=True)
    crash_point("commit.before_manifest")
"""


def test_without_the_variable_no_point_fires(monkeypatch):
    monkeypatch.delenv("BATCHVLM_FAULTS", raising=False)
    assert fault("decode.crash") is None
    crash_point("commit.before_manifest")  # returns


def test_a_fault_reads_its_value_from_the_variable(monkeypatch):
    monkeypatch.setenv("BATCHVLM_FAULTS", "decode.hang=ab12, crash.decode=3")
    assert (fault("decode.hang"), fault("crash.decode"), fault("decode.crash")) == ("ab12", "3", None)


@pytest.mark.slow  # a process of its own
def test_a_crash_point_exits_with_137_on_its_nth_hit():
    env = {**os.environ, "BATCHVLM_FAULTS": "crash.commit.before_manifest=2"}
    result = subprocess.run([sys.executable, "-c", HIT_THREE_TIMES], env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 137 and result.stdout.split() == ["1", "2"]

