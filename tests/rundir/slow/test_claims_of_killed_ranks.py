"""A claim held by a killed rank is taken over."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from batchvlm.rundir.claims import Claim, Claims

# a process of its own
pytestmark = pytest.mark.slow


HOLD_AND_WAIT = """
import sys, time
from pathlib import Path
from batchvlm.rundir.claims import Claims, Heartbeat
claims = Claims(Path(sys.argv[1]), "rank00001-doomed", lease_s=1.0)
Heartbeat(claims)
assert claims.try_claim("unit-a") is not None
print("held", flush=True)
time.sleep(120)
"""


def test_a_claim_held_by_a_killed_rank_is_taken_over(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD_AND_WAIT, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        survivor = Claims(tmp_path, "rank00000-survivor", lease_s=1.0)
        assert survivor.try_claim("unit-a") is None
        time.sleep(2.0)  # two leases: the live holder's heartbeat keeps its claim
        assert survivor.try_claim("unit-a") is None
        assert survivor.try_claim("unit-b") is not None  # unclaimed units are free all along
    finally:
        holder.kill()
        holder.wait()
    time.sleep(1.5)
    taken = survivor.try_claim("unit-a")
    assert taken == Claim("unit-a", 1, "rank00000-survivor")
    assert survivor.holds(taken)
    assert not survivor.holds(Claim("unit-a", 0, "rank00001-doomed"))  # the dead holder could not commit
    assert Claims(tmp_path, "rank00002-late", lease_s=1.0).try_claim("unit-a") is None  # one taker only
