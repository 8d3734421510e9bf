"""Claiming blocks of units at a frontier and waiting on a board: each unit committed once by racing ranks, a killed
holder's uncommitted units alone taken over, an idle rank reading one small file, a stale hint corrected in a gallop."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
from rows import data_row

from batchvlm.records import InputFile, OutputRow, SourceRecord, WorkUnit
from batchvlm.rundir.claims import Claim, Claims, owner_name
from batchvlm.rundir.dedup import BucketPass, bucket_results, bucket_task
from batchvlm.rundir.durable import durable_write_json
from batchvlm.rundir.layout import DATA, RunLayout
from batchvlm.rundir.manifest import RunTotals, all_manifests, listed_shards
from batchvlm.rundir.sink import RunSink
from batchvlm.rundir.frontier import (Backoff, Board, Frontier, Hint, buckets_phase, claimed_so_far, claimed_units,
                                   units_phase, write_board)
from batchvlm.rundir.verify import verify_run
from batchvlm.rundir.workunits import Plan, write_plan

META = {"batchvlm.family": "test"}
NO_EVENTS = {"fallbacks": {}, "parity": {"checked_images": 0, "failed_images": 0}}
QUICK = Backoff(0.01, 0.05)
REPEATS = 150
"""Ids repeat every REPEATS rows, so the duplicate pass has later occurrences to find."""


def planned_run(run_dir: Path, units: int, block_units: int, rows_per_unit: int = 2) -> tuple[RunLayout, Plan]:
    """A run directory holding a plan of `units` units of one input, the earlier rows the larger units."""
    layout = RunLayout(run_dir)
    plan = Plan([InputFile("input", "input.parquet")], {},
                [WorkUnit(f"input-{i * rows_per_unit:08d}-{(i + 1) * rows_per_unit:08d}", "input", i * rows_per_unit,
                          (i + 1) * rows_per_unit, nbytes=units - i) for i in range(units)], 2, block_units)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_plan(layout, plan)
    return layout, plan


def row(index: int) -> dict:
    return data_row(id=f"r{index % REPEATS}", source="input.parquet", row=index, text="t", input_ids=[1, 2],
                    token_tags=[0, 0], num_tokens=2)


def commit_unit(sink: RunSink, unit: WorkUnit, claim: Claim) -> None:
    """The unit's records, each a data row, through the sink, which commits the unit under the claim."""
    sink.start_unit(unit, claim)
    for seq, index in enumerate(range(unit.start, unit.stop)):
        values = row(index)
        sink.add(OutputRow(SourceRecord(values["id"], unit.unit_id, "input.parquet", index, "t", [], seq=seq), DATA,
                           values, NO_EVENTS))
    sink.end_unit(unit, unit.num_rows)


def run_rank(layout: RunLayout, plan: Plan, claims: Claims, attempt: str, main: bool, rank: int) -> None:
    """What a rank of the job does with its claims: the blocks it claims, committed unit by unit, then buckets."""
    claims.beat()  # as the job's Heartbeat on start: a holder with no heartbeat counts as dead
    sink = RunSink(layout, META, "zstd", claims, plan.dedup_buckets, rank=rank)
    blocks = {block.task: block for block in plan.blocks()}
    units_phase(layout, plan, claims, attempt, main, QUICK).work_through(
        lambda claimed: [commit_unit(sink, unit, claim) for unit, claim in claimed_units(layout, blocks, claimed)],
        time.sleep)
    buckets_phase(layout, plan.dedup_buckets, claims, attempt, main, QUICK).work_through(
        BucketPass(layout, {"input": "input.parquet"}, claims), time.sleep)


def finish(layout: RunLayout, plan: Plan) -> None:
    """The run's totals, as rank 0 writes them last, so that verify checks the duplicate pass too."""
    totals = RunTotals.of(all_manifests(layout), bucket_results(layout, plan.dedup_buckets))
    durable_write_json(layout.success, {"records_in": totals.records_in, "written": totals.written,
                                        "quarantined": totals.quarantined})


def data_ids(layout: RunLayout) -> list[str]:
    return sorted(i for _, path in listed_shards(layout, DATA) for i in pq.read_table(path).column("id").to_pylist())


def test_sixteen_ranks_racing_over_200_units_commit_each_exactly_once(tmp_path):
    layout, plan = planned_run(tmp_path, units=200, block_units=4)
    layout.attempt("race").mkdir(parents=True)
    start = threading.Barrier(16)
    errors = []

    def rank(number: int) -> None:
        claims = Claims(layout.claims, owner_name("race", number), lease_s=60)
        start.wait()
        try:
            run_rank(layout, plan, claims, "race", number == 0, number)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=rank, args=(number,)) for number in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    manifests = all_manifests(layout)
    assert len(manifests) == 200 and len({manifest.rank for manifest in manifests}) > 1  # the ranks shared it
    assert [path.name for path in layout.claims.glob("*.1")] == []  # every block claimed once, none taken over
    blocks, checker = plan.block_of(), Claims(layout.claims, "checker", lease_s=60)
    assert all(checker.claim_of(blocks[manifest.unit], manifest.claim).generation == 0 for manifest in manifests)
    finish(layout, plan)
    assert verify_run(layout.root) == []  # every unit once, its files whole, the duplicates listed exactly
    assert data_ids(layout) == sorted(row(index)["id"] for index in range(400))
    assert sum(result["duplicates"] for result in bucket_results(layout, plan.dedup_buckets)) == 400 - REPEATS
    buckets = [bucket_task(bucket) for bucket in range(plan.dedup_buckets)]
    # the hints alone may be short where a slower claimer wrote last; from them a few stats find the claimed prefix
    assert claimed_so_far(layout) <= 50 and claimed_so_far(layout, "dedup") <= plan.dedup_buckets
    assert claimed_so_far(layout, tasks=plan.blocks().tasks) == 50
    assert claimed_so_far(layout, "dedup", buckets) == plan.dedup_buckets


def test_status_counts_the_claimed_blocks_past_a_hint_a_slower_claimer_took_back(tmp_path):
    layout, plan = planned_run(tmp_path, units=40, block_units=4)
    claims = Claims(layout.claims, owner_name("race", 0), lease_s=60)
    tasks = plan.blocks().tasks
    for task in tasks[:7]:
        assert claims.claim_first(task) is not None
    Hint(layout.frontier("units"), "slow").write(3)  # the last write came from a claimer of the 3rd block
    assert claimed_so_far(layout) == 3
    assert claimed_so_far(layout, tasks=tasks) == 7


HOLD_A_BLOCK = """
import sys, time
from pathlib import Path
sys.path[:0] = [sys.argv[2], str(Path(sys.argv[2]).parent)]
from test_frontier import META, QUICK, commit_unit
from batchvlm.rundir.claims import Claims, Heartbeat
from batchvlm.rundir.layout import RunLayout
from batchvlm.rundir.sink import RunSink
from batchvlm.rundir.frontier import units_phase
from batchvlm.rundir.workunits import read_plan

layout = RunLayout(Path(sys.argv[1]))
plan = read_plan(layout)
claims = Claims(layout.claims, "doomed-rank00001-aaaaaaaa", lease_s=1.0)
Heartbeat(claims)
claim = next(iter(units_phase(layout, plan, claims, "doomed", False, QUICK).fresh))
block = plan.blocks()[0]
assert claim.task == block.task
sink = RunSink(layout, META, "zstd", claims, plan.dedup_buckets, rank=1)
for unit in block.units[:2]:
    commit_unit(sink, unit, claim)
print("held", flush=True)
time.sleep(120)
"""


def test_a_rank_killed_while_holding_a_block_loses_only_its_uncommitted_units_to_takeover(tmp_path):
    layout, plan = planned_run(tmp_path, units=12, block_units=4)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_A_BLOCK, str(tmp_path), str(Path(__file__).parent)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
    finally:
        holder.kill()
        holder.wait()
    first = plan.blocks()[0]
    held = Claims(layout.claims, "x", 1.0).claim_of(first.task, "aaaaaaaa0")
    assert held is not None and held.owner == "doomed-rank00001-aaaaaaaa"
    layout.attempt("after").mkdir(parents=True)
    survivor = Claims(layout.claims, "after-rank00000-bbbbbbbb", lease_s=1.0)
    run_rank(layout, plan, survivor, "after", True, 0)  # its holder's process is gone from this host: dead at once
    by_unit = {manifest.unit: manifest for manifest in all_manifests(layout)}
    assert [by_unit[unit.unit_id].claim for unit in first.units] == ["aaaaaaaa0"] * 2 + ["bbbbbbbb1"] * 2
    assert {by_unit[unit.unit_id].claim for block in plan.blocks()[1:] for unit in block.units} == {"bbbbbbbb0"}
    finish(layout, plan)
    assert verify_run(layout.root) == []
    assert data_ids(layout) == sorted(row(index)["id"] for index in range(24))


def test_an_idle_rank_reads_one_small_file_a_look_and_backs_off_until_the_board_says_done(tmp_path):
    from batchvlm.bench.metadata import MetadataOps

    layout, plan = planned_run(tmp_path, units=64, block_units=2)
    layout.attempt("a").mkdir(parents=True)
    busy = Claims(layout.claims, "a-rank00000-busy0000", lease_s=60)
    for block in plan.blocks():  # all claimed, and the hint lost: the idle rank gallops to the end
        busy.claim_first(block.task)
    idle = Claims(layout.claims, "a-rank00001-idle0000", lease_s=60)
    phase = units_phase(layout, plan, idle, "a", False, Backoff(1, 8))
    sleeps = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) == 6:
            write_board(layout.board("a", "units"), Board(1, True))

    with MetadataOps(layout.root) as ops:
        phase.work_through(lambda claimed: list(claimed), sleep)
    assert sleeps == [1, 2, 4, 8, 8, 8]
    assert ops.count("listdir") == 0 and ops.count("scandir") == 0  # nobody lists manifest/, nor anything
    reads = [path for call, path in ops.calls if call == "open"]
    assert reads.count(str(layout.board("a", "units"))) == 7 and not any("manifest" in path for path in reads)
    assert ops.count("stat") <= 2 * len(plan.blocks()).bit_length() + 2  # the gallop over 32 claimed blocks


def test_a_stale_hint_costs_a_gallop_and_a_fresh_one_a_single_look(tmp_path):
    tasks = [f"t{index:03d}" for index in range(300)]
    claims = Claims(tmp_path, "a-rank00000-aaaaaaaa", lease_s=60)
    for task in tasks[:200]:
        claims.claim_first(task)
    looked = []

    def taken(task: str) -> bool:
        looked.append(task)
        return claims.claimed(task)

    frontier = Frontier(tasks, Hint(tmp_path / "t.frontier", claims.owner), claims.claim_first, taken)
    assert frontier.next().task == "t200"
    assert 0 < len(looked) <= 2 * 9  # doubling past 200 claimed tasks, then halving back: not 200 looks
    other = Frontier(tasks, Hint(tmp_path / "t.frontier", "b"), claims.claim_first, taken)
    looked.clear()
    assert other.next().task == "t201" and looked == ["t201"]  # the hint the first claimer wrote


def test_the_tasks_a_board_frees_are_handed_out_one_to_each_rank(tmp_path):
    dead = Claims(tmp_path, "old-rank00000-deadbeef", lease_s=60)
    for task in ("x", "y", "z"):
        dead.claim_first(task)
    ranks = [Claims(tmp_path, f"a-rank{rank:05d}-aaaaaaa{rank}", lease_s=-1) for rank in range(3)]  # dead to them
    board = Board(3, False, ("x", "y", "z"))
    hint = tmp_path / "freed"
    frontiers = [Frontier(board.free, Hint(hint, rank.owner), rank.try_claim, version=board.version)
                 for rank in ranks]
    assert [frontier.next().task for frontier in frontiers] == ["x", "y", "z"]  # each from where the last got to
    assert [frontier.next() for frontier in frontiers] == [None, None, None]
    assert hint.read_text().split() == ["3", "3"]  # the board's version, all handed out
    assert Hint(hint, "b").read(version=4) == 0  # the next board's list starts from its beginning


def test_a_unit_committed_before_its_block_was_claimed_again_is_not_handed_out(tmp_path):
    layout, plan = planned_run(tmp_path, units=4, block_units=4)
    first = Claims(layout.claims, "a-rank00000-aaaaaaaa", lease_s=60)
    block = plan.blocks()[0]
    claim = first.claim_first(block.task)
    sink = RunSink(layout, META, "zstd", first, plan.dedup_buckets)
    commit_unit(sink, block.units[1], claim)
    handed = [unit.unit_id for unit, _ in claimed_units(layout, {block.task: block}, [claim])]
    assert handed == [block.units[0].unit_id, *(unit.unit_id for unit in block.units[2:])]


def test_the_tails_wait_doubles_from_poll_s_to_eight_times_it_and_never_past_a_quarter_lease():
    defaults, short_lease = Backoff.of_tail(2, 120), Backoff.of_tail(0.2, 2)
    assert [defaults.next() for _ in range(5)] == [2, 4, 8, 16, 16]
    assert [short_lease.next() for _ in range(3)] == [0.2, 0.4, 0.5]
    defaults.reset()
    assert defaults.next() == 2
