"""Work claiming through the run directory: one holder per unit, taken over when its holder dies."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

from batchvlm.rundir.claims import Claim, Claims

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


def test_of_ranks_racing_for_expired_claims_exactly_one_wins_each(tmp_path):
    """Eight ranks, as threads released together per unit, try to take over each of 40 units a dead rank held."""
    units = [f"unit-{index:02d}" for index in range(40)]
    dead = Claims(tmp_path, "rank00001-dead", lease_s=0.1)
    for unit in units:
        dead.try_claim(unit)
    time.sleep(0.3)
    racers = [Claims(tmp_path, f"rank{rank:05d}-alive", lease_s=0.1) for rank in range(2, 10)]
    start = threading.Barrier(len(racers))
    won: dict[str, list] = {unit: [] for unit in units}

    def race(claims: Claims) -> None:
        for unit in units:
            start.wait()
            if (claim := claims.try_claim(unit)) is not None:
                won[unit].append(claim)

    threads = [threading.Thread(target=race, args=(claims,)) for claims in racers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert {unit: len(claims) for unit, claims in won.items()} == {unit: 1 for unit in units}
    assert all(claims[0].generation == 1 and racers[0].holds(claims[0]) for claims in won.values())
