"""Work claiming through the run directory: one holder per unit, taken over when its holder dies."""

from __future__ import annotations

import threading
import time

from batchvlm.rundir.claims import Claim, Claims, Heartbeat


def test_of_ranks_racing_for_expired_claims_exactly_one_wins_each(tmp_path):
    """Eight ranks, as threads released together per unit, try to take over each of 40 units a dead rank held."""
    units = [f"unit-{index:02d}" for index in range(40)]
    clock = Clock(time.time())  # moved past the dead rank's lease; still while they race, so no winner's lease ends
    dead = Claims(tmp_path, "rank00001-dead", lease_s=0.1, clock=clock)
    for unit in units:
        dead.try_claim(unit)
    clock.now += 0.3
    racers = [Claims(tmp_path, f"rank{rank:05d}-alive", lease_s=0.1, clock=clock) for rank in range(2, 10)]
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


class Clock:
    """A clock the test moves: a host's time, as Claims reads and writes it."""

    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_a_heartbeat_from_a_host_whose_clock_is_ahead_is_fresh_for_one_lease_and_reported_once(tmp_path, caplog):
    here, fast = Clock(1_000_000.0), Clock(1_000_000.0 + 3600)  # a host an hour ahead
    holder = Claims(tmp_path, "a-rank00001-fast", lease_s=60, clock=fast)
    holder.beat()  # as its Heartbeat does from the start
    assert holder.try_claim("unit-a") is not None
    survivor = Claims(tmp_path, "a-rank00000-here", lease_s=60, clock=here)
    assert survivor.try_claim("unit-a") is None  # first seen now: alive
    for _ in range(3):  # a live holder beats every quarter lease: each new beat counts from when it is first seen
        here.now += 30
        fast.now += 30
        holder.beat()
        assert survivor.try_claim("unit-a") is None
    here.now += 59  # the holder died: its last beat, seen a lease ago, still an hour ahead of this clock
    assert survivor.try_claim("unit-a") is None
    here.now += 2
    assert survivor.try_claim("unit-a") == Claim("unit-a", 1, "a-rank00000-here")
    ahead = [record.getMessage() for record in caplog.records if "ahead" in record.getMessage()]
    assert len(ahead) == 1 and "a-rank00001-fast" in ahead[0] and "3600 s ahead" in ahead[0]


def test_a_heartbeat_on_an_injected_clock_ages_with_it(tmp_path):
    clock = Clock(5000.0)
    holder = Claims(tmp_path, "a-rank00001-holder", lease_s=10, clock=clock)
    holder.beat()
    assert holder.try_claim("unit-a") is not None
    other = Claims(tmp_path, "a-rank00000-other", lease_s=10, clock=clock)
    clock.now += 9
    assert other.try_claim("unit-a") is None and not other.expired("a-rank00001-holder")
    clock.now += 2
    assert other.expired("a-rank00001-holder") and other.try_claim("unit-a").generation == 1


def test_the_heartbeat_beats_every_quarter_lease_of_its_clock(tmp_path):
    clock, beats = Clock(100.0), []
    claims = Claims(tmp_path, "a-rank00000-beating", lease_s=8, clock=clock)

    def wait(seconds: float) -> bool:  # no sleep: the clock moves by the wait, and the beat before it is seen
        beats.append((claims.alive / claims.owner).stat().st_mtime)
        clock.now += seconds
        return len(beats) == 4

    Heartbeat(claims, wait).thread.join(timeout=10)
    assert beats == [100.0, 102.0, 104.0, 106.0]
