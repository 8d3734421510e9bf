"""batchvlm-status: where a run stands from the ranks' reports and heartbeats, never from its manifests."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from batchvlm.config import ConfigError
from batchvlm.records import WorkUnit
from batchvlm.review.status import format_status, run_status
from batchvlm.rundir.claims import Claims, owner_name
from batchvlm.rundir.layout import RunLayout
from batchvlm.rundir.rank_reports import RankReporter, RankUnits
from batchvlm.rundir.manifest import Manifest
from batchvlm.rundir.verify import verify_run
from batchvlm.rundir.workunits import Plan, write_plan


def planned_run(root: Path, units: int = 10, rows: int | None = 100) -> RunLayout:
    layout = RunLayout(root)
    root.mkdir(parents=True, exist_ok=True)
    write_plan(layout, Plan([], {}, [WorkUnit(f"u{i:03d}", "in", i * 100, None if rows is None else i * 100 + rows)
                                     for i in range(units)], dedup_buckets=1))
    return layout


def report_rank(layout: RunLayout, attempt: str, rank: int, samples: list[tuple[float, int]], claimed: int,
                committed: int, quarantined: int = 0) -> Claims:
    """A rank's report as a rank writes it (RankReporter), with `samples` of (seconds ago, records committed), and its
    heartbeat."""
    records_in = samples[-1][1]
    units = RankUnits(claimed=claimed, committed=committed, records_in=records_in, written=records_in - quarantined,
                      quarantined=quarantined, bytes=1000 * committed)
    units.by_check.update({"decode.unreadable": quarantined} if quarantined else {})
    reporter = RankReporter(layout, attempt, rank, units)
    layout.attempt(attempt).mkdir(parents=True, exist_ok=True)
    now = time.time()
    for ago, records in samples:
        reporter.samples.append((now - ago, records, committed, records))
    reporter.write(records_in)
    claims = Claims(layout.claims, owner_name(attempt, rank), lease_s=60)
    claims.beat()
    return claims


def test_a_run_in_progress_sums_its_ranks_and_flags_the_one_whose_heartbeat_is_older_than_the_lease(tmp_path):
    layout = planned_run(tmp_path / "run")
    report_rank(layout, "a1", 0, [(60, 0), (30, 150), (0, 300)], claimed=4, committed=3, quarantined=7)
    silent = report_rank(layout, "a1", 1, [(60, 0), (0, 200)], claimed=3, committed=2)
    beat = layout.claims / "alive" / silent.owner
    beat.write_text(json.dumps({"host": "another-node", "pid": 1}))  # its process cannot be looked for here
    os.utime(beat, (time.time() - 600, time.time() - 600))

    status = run_status(layout.root)
    assert (status.state, status.units_total, status.units_committed) == ("running", 10, 5)
    assert (status.records_total, status.records_in, status.quarantined) == (1000, 500, 7)
    assert status.by_check == {"decode.unreadable": 7} and status.bytes_written == 5000
    assert (status.blocks_claimed, status.blocks_total) == (0, 10)  # no rank wrote the frontier's hint here
    first, second = status.ranks
    assert not first.stale and first.units_held == 1 and first.heartbeat_age_s < 5
    assert second.stale and "no heartbeat for" in second.why_stale and second.heartbeat_age_s > 500
    assert status.rate == pytest.approx(5.0, rel=0.01)  # the live rank's 300 records in 60 s; the stale one's left out
    assert status.eta_s == pytest.approx(100.0, rel=0.01)  # 500 records left
    shown = format_status(status)
    assert "5 / 10 committed (50.0%), 1 held, 1 held by stale ranks" in shown and "decode.unreadable 7" in shown
    assert "1 rank(s) live, 1 STALE" in shown and "eta 01:40" in shown


def test_without_row_counts_the_eta_comes_from_the_units_committed(tmp_path):
    layout = planned_run(tmp_path / "run", rows=None)
    reporter = RankReporter(layout, "a1", 0, RankUnits(claimed=2, committed=0))
    layout.attempt("a1").mkdir(parents=True)
    now = time.time()
    reporter.samples.extend([(now - 100, 0, 0, 0), (now - 50, 100, 2, 100)])
    reporter.units.committed = 4
    reporter.write(200)
    Claims(layout.claims, owner_name("a1", 0), lease_s=60).beat()
    status = run_status(layout.root)
    assert status.records_total is None and status.unit_rate == pytest.approx(0.04, rel=0.01)
    assert status.eta_s == pytest.approx(6 / 0.04, rel=0.01)


def test_a_run_whose_ranks_all_finished_or_died_is_stopped_and_says_how_to_finish_it(tmp_path):
    layout = planned_run(tmp_path / "run")
    claims = report_rank(layout, "a1", 0, [(10, 0), (0, 100)], claimed=1, committed=1)
    os.utime(claims.alive / claims.owner, (time.time() - 3600, time.time() - 3600))
    status = run_status(layout.root)
    assert status.state == "stopped" and status.eta_s is None
    assert "launch the job again to finish it" in format_status(status)


def test_a_folder_that_holds_no_run_is_refused_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match="run_dir="):
        run_status(tmp_path)


def test_a_run_whose_ranks_beat_before_any_reported_is_starting_not_not_started(tmp_path):
    layout = planned_run(tmp_path / "run")
    assert run_status(layout.root).state == "not started"
    Claims(layout.claims, owner_name("a1", 0), lease_s=60).beat()  # a rank up, loading its model
    status = run_status(layout.root)
    assert status.state == "starting" and "starting: its ranks beat, none has reported yet" in format_status(status)


def test_the_units_in_progress_are_named_with_how_long_their_rank_has_held_them(tmp_path):
    layout = planned_run(tmp_path / "run")
    units = RankUnits()
    now = time.time()
    units.hold(["u000", "u001"], at=now - 600)  # a block claimed ten minutes ago
    units.hold(["u002", "u003"], at=now - 30)
    units.commit(Manifest("u000", "in", 0, 100, 100, 100, 0, {}, {}, 0, "a0"))
    units.lose("u002")  # another rank took it over
    layout.attempt("a1").mkdir(parents=True)
    RankReporter(layout, "a1", 0, units).write(100)
    Claims(layout.claims, owner_name("a1", 0), lease_s=60).beat()
    status = run_status(layout.root, now=now + 5)
    assert status.state == "running" and status.ranks[0].units_held == 2
    assert [(unit, round(age)) for unit, _, age in status.in_progress] == [("u001", 605), ("u003", 35)]
    assert ("in progress: 2 units held by live ranks, the longest first (held since claimed)\n"
            "             10:05  rank 0  u001\n             00:35  rank 0  u003\n") in format_status(status)


def test_a_heartbeat_from_a_host_whose_clock_is_ahead_is_shown_with_the_skew(tmp_path):
    layout = planned_run(tmp_path / "run")
    claims = report_rank(layout, "a1", 0, [(10, 0), (0, 100)], claimed=1, committed=1)
    os.utime(claims.alive / claims.owner, (time.time() + 3600, time.time() + 3600))
    status = run_status(layout.root)
    assert status.ranks[0].clock_ahead_s == pytest.approx(3600, abs=5) and not status.ranks[0].stale
    shown = format_status(status)
    assert "3600 s ahead" in shown and "clock skew:  the heartbeats of 1 rank(s) are up to 3600 s ahead" in shown


FOREIGN = {"another tool's": '{"units": [{"name": "part-0"}]}', "a list": "[]", "truncated": '{"inputs": [], "par',
           "not text": b"\xff\xfe\x00", "empty": ""}


@pytest.mark.parametrize("content", FOREIGN.values(), ids=FOREIGN.keys())
def test_status_and_verify_on_a_plan_batchvlm_did_not_write_say_so(tmp_path, content):
    (tmp_path / "units.json").write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ConfigError, match=f"{tmp_path / 'units.json'} is not a .*batchvlm did not write it, or it is "
                                          "damaged"):
        run_status(tmp_path)
    (problem,) = verify_run(tmp_path)
    assert problem.startswith(f"{tmp_path / 'units.json'} is not a")


@pytest.mark.parametrize("content", ['{"records": 3}', "{"])
def test_status_and_verify_on_damaged_totals_say_so(tmp_path, content):
    layout = planned_run(tmp_path / "run", units=0)
    layout.success.write_text(content)
    with pytest.raises(ConfigError, match="_SUCCESS .*batchvlm did not write it, or it is damaged"):
        run_status(layout.root)
    if content == "{":
        assert verify_run(layout.root) == [f"{layout.success} is not a JSON file (JSONDecodeError: Expecting property "
                                           "name enclosed in double quotes: line 1 column 2 (char 1)): batchvlm did "
                                           "not write it, or it is damaged"]
