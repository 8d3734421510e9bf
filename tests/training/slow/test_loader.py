"""The training loader on a real run (the Qwen2-VL demo, bf16 as the job writes it by default): packed batches
that add up, every record once per epoch over ranks and workers, a seeded shuffle, exact resume."""

from __future__ import annotations

import shutil
from dataclasses import replace
from concurrent.futures import ThreadPoolExecutor

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch
from conftest import REPO, committed_shards, embed_in_process, relist

from batchvlm.rundir.layout import RunLayout
from batchvlm.rundir.manifest import all_manifests
from batchvlm.rundir.verify import verify_run
from batchvlm.training.reader import read_run
from batchvlm.training import (LoaderConfig, PackedLoader, RunNotFinished,
                               pack)
from batchvlm.training.loader import READ_AHEAD, RunIndex, _OpenRowGroups

SMALL = LoaderConfig(max_tokens=800, shuffle_buffer=4, pack_buffer=8, num_workers=0)


def ids_of(batches) -> list[list[str]]:
    return [batch.ids for batch in batches]


def pack_ids(loader: PackedLoader, packs) -> list[list[str]]:
    """The record ids of planned packs, read from the shards' id column alone."""
    ids = [pq.read_table(path, columns=["id"]).column("id").to_pylist() for path in loader.index.shards]
    return [[ids[shard][row] for shard, row in refs] for refs in packs]


@pytest.mark.slow
def test_a_run_without_success_is_refused_unless_asked(qwen_run, tmp_path):
    unfinished = tmp_path / "unfinished"
    shutil.copytree(qwen_run, unfinished)
    (unfinished / "_SUCCESS").unlink()
    with pytest.raises(RunNotFinished, match="_SUCCESS"):
        PackedLoader(unfinished, SMALL)
    assert len(PackedLoader(unfinished, replace(SMALL, allow_unfinished=True))) > 0


@pytest.mark.slow
def test_ranks_and_workers_together_read_every_record_once_per_epoch(qwen_run, records):
    config = replace(SMALL, num_workers=2)
    ranks = [PackedLoader(qwen_run, config, rank=r, world_size=2) for r in range(2)]
    packs = pack_ids(ranks[0], ranks[0].epoch_packs())
    read = [ids_of(loader) for loader in ranks]
    assert len(read[0]) == len(read[1]) == len(packs) // 2
    assert read[0] == packs[0:len(packs) // 2 * 2:2] and read[1] == packs[1:len(packs) // 2 * 2:2]
    seen = [i for rank in read for batch in rank for i in batch]
    dropped = packs[len(packs) // 2 * 2:]  # the tail that would leave one rank a batch short
    assert sorted(seen + sum(dropped, [])) == sorted(r.id for r in records)


@pytest.mark.slow
def test_the_shuffle_is_fixed_by_the_seed_and_changes_with_the_epoch(qwen_run):
    first, again = PackedLoader(qwen_run, SMALL), PackedLoader(qwen_run, SMALL)
    epoch0 = ids_of(first)
    assert ids_of(again) == epoch0
    epoch1 = ids_of(first)
    assert first.epoch == 2 and epoch1 != epoch0
    assert sorted(sum(epoch1, [])) == sorted(sum(epoch0, []))
    assert ids_of(PackedLoader(qwen_run, replace(SMALL, seed=1))) != epoch0


@pytest.mark.slow
def test_state_dict_resumes_mid_epoch_exactly(qwen_run):
    config = replace(SMALL, num_workers=2)
    straight = PackedLoader(qwen_run, config)
    expected = ids_of(straight) + ids_of(straight)
    interrupted = PackedLoader(qwen_run, config)
    taken = []
    for batch in interrupted:
        taken.append(batch.ids)
        if len(taken) == 2:
            break
    resumed = PackedLoader(qwen_run, config)
    resumed.load_state_dict(interrupted.state_dict())
    assert taken + ids_of(resumed) + ids_of(resumed) == expected


@pytest.mark.slow
def test_resume_under_another_world_size_deals_the_remaining_packs_once(qwen_run):
    two = [PackedLoader(qwen_run, SMALL, rank=r, world_size=2) for r in range(2)]
    for loader in two:
        next(iter(loader))
    state = two[0].state_dict()
    remaining = pack_ids(two[0], two[0].epoch_packs()[2:])
    for world in (1, 3):
        resumed = [PackedLoader(qwen_run, SMALL, rank=r, world_size=world) for r in range(world)]
        for loader in resumed:
            loader.load_state_dict(state)
        batches = [batch for loader in resumed for batch in ids_of(loader)]
        assert sorted(batches) == sorted(remaining[:len(remaining) // world * world]), world


@pytest.mark.slow
def test_resume_with_another_packing_is_refused(qwen_run):
    state = PackedLoader(qwen_run, SMALL).state_dict()
    with pytest.raises(ValueError, match="packs would differ"):
        PackedLoader(qwen_run, replace(SMALL, max_tokens=900)).load_state_dict(state)


@pytest.mark.slow
@pytest.mark.parametrize("run", ["qwen_run", "siglip_run"])
def test_the_loaders_batches_are_the_packs_of_the_records_read_back(run, request):
    """The loader packs from a shard's columns (reader.ShardColumns), `pack` from records read as tensors: the same."""
    run_dir = request.getfixturevalue(run)
    by_id = {record.id: record for record in read_run(run_dir)}
    batches = list(PackedLoader(run_dir, SMALL))
    assert sum(len(batch.ids) for batch in batches) == len(by_id)
    for batch in batches:
        expected = pack([by_id[i] for i in batch.ids], SMALL.max_tokens)
        for name, value in vars(expected).items():
            if isinstance(value, torch.Tensor):
                got = getattr(batch, name)
                assert got.dtype == value.dtype and torch.equal(got, value), name
        assert expected.extras.keys() == batch.extras.keys()
        assert all(torch.equal(batch.extras[k], v) for k, v in expected.extras.items())


@pytest.mark.slow
def test_a_worker_holds_the_row_groups_its_remaining_packs_need_and_reads_ahead_a_bounded_few(qwen_run):
    loader = PackedLoader(qwen_run, replace(SMALL, shuffle_buffer=1))
    packs = loader.epoch_packs()
    with ThreadPoolExecutor(1) as reader:
        groups = _OpenRowGroups(loader.index, packs, reader)
        for k, refs in enumerate(packs):
            for shard, row in refs:
                assert groups.record(shard, row).id == pack_ids(loader, [[(shard, row)]])[0][0]
            groups.done_with(k)
            still_needed = {groups.group_of(shard, row) for later in packs[k + 1:] for shard, row in later}
            assert set(groups.open) <= still_needed and len(groups.reading) <= READ_AHEAD
    assert not groups.open and not groups.reading


@pytest.mark.slow
def test_the_documented_training_loop_trains_on_the_run_and_checkpoints_a_resumable_loader(qwen_run, tmp_path,
                                                                                           monkeypatch):
    page = (REPO / "docs" / "training.md").read_text()
    section = page[page.index("## Training on the output"):]
    code = section[section.index("```python") + len("```python"):section.index("```\n", section.index("```python"))]
    monkeypatch.chdir(tmp_path)  # the loop writes checkpoint.pt where it runs
    scope: dict = {}
    exec(code.replace('"outputs/demo-qwen2_vl_tiny"', repr(str(qwen_run))), scope)
    assert scope["loader"].epoch == 2 and torch.isfinite(scope["loss"])
    resumed = PackedLoader(qwen_run, LoaderConfig(max_tokens=1024, seed=0))
    resumed.load_state_dict(torch.load(tmp_path / "checkpoint.pt")["loader"])
    assert (resumed.epoch, resumed.next_pack) == (1, 1)


@pytest.mark.slow
def test_only_the_shards_a_manifest_lists_are_read(qwen_run, records):
    stray = qwen_run / "data" / "stray.parquet"
    shutil.copy(committed_shards(qwen_run)[0], stray)  # an orphan of a crashed attempt: same ids again
    try:
        read = [i for batch in ids_of(PackedLoader(qwen_run, SMALL)) for i in batch]
    finally:
        stray.unlink()
    assert sorted(read) == sorted(r.id for r in records)


@pytest.mark.slow
def test_a_run_cut_into_files_of_a_few_row_groups_reads_back_as_the_run_in_one_file_a_unit(qwen_run, records,
                                                                                          tmp_path):
    small = 150_000  # bytes of a data file at most (records of ~35 kB): several files a unit
    cut = embed_in_process(tmp_path, "cut", "model=qwen2_vl_tiny", f"output.shard_bytes={small}")
    assert verify_run(cut) == []
    manifests = all_manifests(RunLayout(cut))
    files = [listing for manifest in manifests for listing in manifest.shards("data")]
    assert len(files) > len(manifests) and all(listing.bytes <= small for listing in files)
    assert {pq.read_metadata(cut / listing.path).num_row_groups for listing in files} - {1}  # groups of a file
    read = {record.id: record for record in read_run(cut)}
    assert sorted(read) == sorted(record.id for record in records)
    assert all(torch.equal(read[record.id].image_embeds, record.image_embeds) for record in records)
    loader = PackedLoader(cut, SMALL)
    batches = list(loader)
    assert sorted(i for batch in batches for i in batch.ids) == sorted(read)
    assert len(loader.index.shards) == len(files)


@pytest.mark.slow
def test_start_up_reads_each_rows_token_count_not_its_ids(qwen_run, tmp_path):
    """Opening a run costs O(shards): the few bytes of num_tokens a row, not the input_ids lists (a run written
    before the column was stored has it made from its lists' lengths by the upgrade: tests/rundir/slow/test_upgrade_runs.py)."""
    copy = tmp_path / "run"
    shutil.copytree(qwen_run, copy)
    expected = RunIndex.of(qwen_run).lengths
    first = committed_shards(copy)[0]
    table = pq.read_table(first)
    doubled = table.set_column(table.schema.get_field_index("num_tokens"), "num_tokens",
                               pc.multiply(table.column("num_tokens"), 2))
    pq.write_table(doubled, first)
    relist(copy, first)
    assert RunIndex.of(copy).lengths[0].tolist() == (expected[0] * 2).tolist()  # the column, not the lists
