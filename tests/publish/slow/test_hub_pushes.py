"""batchvlm-push against the local stand-in for the Hub (fake_hub.py): runs pushed, read back with
`datasets.load_dataset` bit for bit, pushes resumed, raced, locked and refused."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from conftest import committed_shards, embed_in_process
from fake_hub import FakeHub
from PIL import Image
from test_upgrade_runs import as_format_1
from skimage import data

from batchvlm.publish import hub as hub_module
from batchvlm.publish.hub import (CARD, VIEWER_ROW_GROUP_BYTES, PushConfig, PushRefused, format_push,
                                  oversized_row_groups, published_shards, push_run)
from batchvlm.rundir.layout import RunLayout
from batchvlm.rundir.manifest import all_manifests
from batchvlm.training import DatasetRows
from batchvlm.training.reader import read_run
from test_hub import REPO_ID

# demo runs pushed, and the push job as a process
pytestmark = pytest.mark.slow


ROOM = Path(__file__).resolve().parents[1]
"""tests/publish/, fake_hub.py's folder: on the path of a push run in a process of its own."""

KILLED_PUSH = f"""
import os, signal, sys
from pathlib import Path
from fake_hub import FakeHub
from PIL import Image
from skimage import data
from batchvlm.publish.hub import PushConfig, push_run

hub = FakeHub(Path(sys.argv[2]))
hub.before_commit = lambda: hub.commit_calls == 2 and os.kill(os.getpid(), signal.SIGKILL)
push_run(PushConfig(run_dir=sys.argv[1], repo_id="{REPO_ID}", license="cc-by-4.0", files_per_commit=1), hub)
"""
"""A push in its own process, killed (SIGKILL: no `finally` runs) as it starts its second commit."""


def push(run_dir: Path, hub: FakeHub, **settings):
    return push_run(PushConfig(run_dir=str(run_dir), repo_id=REPO_ID, license="cc-by-4.0", **settings), hub)


def card_files(hub: FakeHub) -> list[str]:
    """The data files the pushed card's `configs:` lists."""
    header = (hub.folder(REPO_ID) / CARD).read_text().split("---\n")[1]
    (config,) = yaml.safe_load(header)["configs"]
    (split,) = config["data_files"]
    return split["path"]


def repo_data_files(hub: FakeHub) -> list[str]:
    folder = hub.folder(REPO_ID)
    return sorted(path.relative_to(folder).as_posix() for path in (folder / "data").rglob("*") if path.is_file())


def copy_of(run_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / run_dir.name
    shutil.copytree(run_dir, copy)
    return copy


def assert_bit_equal(ours, record) -> None:
    """Every field of two RecordTensors equal, tensors bit for bit (a NaN or a -0.0 too)."""
    for field in dataclasses.fields(record):
        got, expected = getattr(ours, field.name), getattr(record, field.name)
        pairs = got.items() if isinstance(got, dict) else [(field.name, got)]
        if isinstance(got, dict):
            assert got.keys() == expected.keys(), (record.id, field.name)
        for name, value in pairs:
            stored = expected[name] if isinstance(got, dict) else expected
            if isinstance(value, torch.Tensor):
                assert value.dtype == stored.dtype and value.shape == stored.shape, (record.id, name)
                assert torch.equal(value.reshape(-1).view(torch.uint8), stored.reshape(-1).view(torch.uint8)), \
                    (record.id, name)
            else:
                assert value == stored, (record.id, name)


def assert_rows_are(dataset, records) -> None:
    rows = DatasetRows.from_dataset(dataset)
    read = [rows.tensors(row) for row in dataset]
    assert [record.id for record in read] == [record.id for record in records]
    for ours, record in zip(read, records):
        assert_bit_equal(ours, record)


@pytest.mark.parametrize("run", ["qwen_run", "siglip_run"])
def test_load_dataset_on_the_pushed_repo_gives_the_rows_of_read_run_bit_for_bit_streaming_and_not(run, request,
                                                                                                  tmp_path):
    run_dir = request.getfixturevalue(run)
    hub = FakeHub(tmp_path / "hub")
    result = push(run_dir, hub, files_per_commit=3)
    shards = published_shards(RunLayout(run_dir))
    assert card_files(hub) == [shard.repo_path for shard in shards] == repo_data_files(hub) == result.uploaded[:-1]
    assert "*" not in (hub.folder(REPO_ID) / CARD).read_text().split("---\n")[1]  # explicit files, never a glob
    everything = {path.relative_to(hub.folder(REPO_ID)).as_posix() for path in hub.folder(REPO_ID).rglob("*")
                  if path.is_file()}
    assert everything == {".gitattributes", CARD, *card_files(hub)}  # no quarantine shard, no ids, no manifest
    paths = result.uploaded[:-1]
    assert [commit.paths for commit in hub.commits(REPO_ID)[1:]] == [paths[i:i + 3] for i in range(0, len(paths), 3)] \
        + [[CARD]]
    records = list(read_run(run_dir))
    folder = str(hub.folder(REPO_ID))
    assert_rows_are(datasets.load_dataset(folder, split="train", cache_dir=str(tmp_path / "cache")), records)
    assert_rows_are(datasets.load_dataset(folder, split="train", streaming=True), records)
    for path in repo_data_files(hub):  # the viewer reads every row group of them
        metadata = pq.read_metadata(hub.folder(REPO_ID) / path)
        assert all(metadata.row_group(group).total_byte_size <= VIEWER_ROW_GROUP_BYTES
                   for group in range(metadata.num_row_groups))
    assert not RunLayout(run_dir).push_lock.exists()


def test_a_run_with_clips_loads_back_bit_for_bit_and_its_card_states_the_clips(clip_run, tmp_path):
    """Output format 3's clip columns (video_embeds, video_spans, ...) published as they are, and the card says what
    they hold, how many rows have clips and the clip rule the run sampled them by."""
    hub = FakeHub(tmp_path / "hub")
    push(clip_run, hub)
    records = list(read_run(clip_run))
    assert sum(record.video_embeds is not None for record in records) == 3
    folder = str(hub.folder(REPO_ID))
    assert_rows_are(datasets.load_dataset(folder, split="train", cache_dir=str(tmp_path / "cache")), records)
    assert_rows_are(datasets.load_dataset(folder, split="train", streaming=True), records)
    card = (hub.folder(REPO_ID) / CARD).read_text()
    assert "- video" in card.split("---\n")[1]  # a tag
    assert "`video_embeds` [rows, 64]" in card and "clips: 3 of the 3 rows hold clips" in card
    assert "Qwen2VLVideoProcessor" in card and '"fps": 2.0' in card and "second_per_grid_ts" in card


def test_a_push_reads_each_shards_footer_once(clip_run, tmp_path, monkeypatch):
    """A shard's footer gives the row-group check and the card's facts (embedding columns, rows with clips) alike."""
    footers_read, read_metadata = [], pq.read_metadata
    monkeypatch.setattr(pq, "read_metadata", lambda where, *args, **kwargs: (
        footers_read.append(Path(where)), read_metadata(where, *args, **kwargs))[1])
    monkeypatch.setattr(pq, "read_schema", None)  # a footer read too, which the card no longer makes
    push(clip_run, FakeHub(tmp_path / "hub"))
    assert sorted(path for path in footers_read if path.is_relative_to(clip_run)) == sorted(committed_shards(clip_run))


def test_a_run_of_more_shards_than_a_folder_takes_is_spread_over_folders_and_reads_back_in_order(qwen_run, tmp_path,
                                                                                                 monkeypatch):
    monkeypatch.setattr(hub_module, "SHARDS_PER_FOLDER", 3)  # the Hub wants under 10k entries a folder
    hub = FakeHub(tmp_path / "hub")
    push(qwen_run, hub)
    names = [Path(listing.path).name for manifest in all_manifests(RunLayout(qwen_run))
             for listing in manifest.shards("data")]
    assert card_files(hub) == [f"data/{index // 3:05d}/{name}" for index, name in enumerate(names)]
    dataset = datasets.load_dataset(str(hub.folder(REPO_ID)), split="train", cache_dir=str(tmp_path / "cache"))
    assert_rows_are(dataset, list(read_run(qwen_run)))


def test_a_crashed_attempts_stray_files_are_neither_uploaded_nor_referenced(qwen_run, tmp_path):
    run_dir = copy_of(qwen_run, tmp_path)
    shard = committed_shards(run_dir)[0]
    unit = shard.name.split(".")[0]
    stray = shard.with_name(f"{unit}.0badc1a1m.parquet")  # an outrun holder's shard: no manifest lists it
    shutil.copy(shard, stray)
    temporary = shard.with_name(f".{shard.name}.tmp-4242")
    temporary.write_bytes(b"half a shard")
    hub = FakeHub(tmp_path / "hub")
    push(run_dir, hub)
    names = {Path(path).name for path in repo_data_files(hub)}
    assert names == {path.name for path in committed_shards(run_dir)}
    card = (hub.folder(REPO_ID) / CARD).read_text()
    assert stray.name not in card and temporary.name not in card


def test_another_runs_files_left_in_the_repo_are_named_and_not_referenced(qwen_run, siglip_run, tmp_path):
    hub = FakeHub(tmp_path / "hub")
    push(qwen_run, hub)
    earlier = repo_data_files(hub)
    result = push(siglip_run, hub)
    assert result.unreferenced == earlier and set(earlier) <= set(repo_data_files(hub))  # left as they were
    assert card_files(hub) == [shard.repo_path for shard in published_shards(RunLayout(siglip_run))]
    assert_rows_are(datasets.load_dataset(str(hub.folder(REPO_ID)), split="train", cache_dir=str(tmp_path / "cache")),
                    list(read_run(siglip_run)))
    assert f"{len(earlier)} files under data/ in the repo are not this run's" in format_push(result)


def test_a_second_push_of_an_unchanged_run_commits_nothing(qwen_run, tmp_path):
    hub = FakeHub(tmp_path / "hub")
    push(qwen_run, hub)
    commits = list(hub.commits(REPO_ID))
    calls = hub.commit_calls
    again = push(qwen_run, hub)
    assert (again.uploaded, again.commits) == ([], [])
    assert hub.commits(REPO_ID) == commits and hub.commit_calls == calls  # not even an empty commit asked for


def test_a_push_killed_after_its_first_commit_leaves_its_lock_to_the_next_which_uploads_only_the_rest(qwen_run,
                                                                                                     tmp_path, caplog):
    run_dir = copy_of(qwen_run, tmp_path)
    killed = subprocess.run([sys.executable, "-c", KILLED_PUSH, str(run_dir), str(tmp_path / "hub")],
                            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOM), os.environ["PYTHONPATH"]])},
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    lock = RunLayout(run_dir).push_lock
    assert json.loads(lock.read_text())["host"] == socket.gethostname()  # left behind by a process now gone
    hub = FakeHub(tmp_path / "hub")  # the hub as the killed push left it
    paths = [shard.repo_path for shard in published_shards(RunLayout(run_dir))]
    assert repo_data_files(hub) == paths[:1] and not (hub.folder(REPO_ID) / CARD).exists()
    resumed = push(run_dir, hub, files_per_commit=1)
    assert resumed.uploaded == paths[1:] + [CARD]
    assert "was left by a push whose process is gone" in caplog.text and not lock.exists()
    assert_rows_are(datasets.load_dataset(str(hub.folder(REPO_ID)), split="train", cache_dir=str(tmp_path / "cache")),
                    list(read_run(run_dir)))


def test_a_push_stopped_by_the_network_after_its_first_commit_resumes_uploading_only_the_rest(qwen_run, tmp_path):
    hub = FakeHub(tmp_path / "hub", fail_at_commit=2)
    with pytest.raises(ConnectionError):
        push(qwen_run, hub, files_per_commit=1)
    assert not RunLayout(qwen_run).push_lock.exists()
    paths = [shard.repo_path for shard in published_shards(RunLayout(qwen_run))]
    assert repo_data_files(hub) == paths[:1] and not (hub.folder(REPO_ID) / CARD).exists()
    hub.fail_at_commit = None
    resumed = push(qwen_run, hub, files_per_commit=1)
    assert resumed.uploaded == paths[1:] + [CARD]
    assert [commit.paths for commit in hub.commits(REPO_ID)[1:]] == [[path] for path in paths] + [[CARD]]
    assert card_files(hub) == paths


def hold_lock(run_dir: Path, host: str, pid: int) -> Path:
    lock = RunLayout(run_dir).push_lock
    lock.write_text(json.dumps({"host": host, "pid": pid, "repo_id": "other/repo", "since": 0.0}))
    return lock


def test_a_concurrent_push_of_the_run_is_refused_naming_the_holder_and_the_file(qwen_run, tmp_path):
    run_dir = copy_of(qwen_run, tmp_path)
    hub = FakeHub(tmp_path / "hub")
    for host, pid in [(socket.gethostname(), os.getppid()), ("node-17", 1234)]:  # alive here, or elsewhere
        lock = hold_lock(run_dir, host, pid)
        with pytest.raises(PushRefused, match=f"pid {pid} on {host}, pushing to other/repo") as refused:
            push(run_dir, hub)
        assert f"remove {lock} and push again" in str(refused.value)
        assert REPO_ID not in hub.repos and lock.exists()  # nothing done, the holder's lock kept


def test_a_push_started_while_another_is_uploading_the_run_is_refused(qwen_run, tmp_path):
    hub = FakeHub(tmp_path / "hub")
    uploading, refused = threading.Event(), []

    def second_push():  # runs while the first push is inside its first commit
        if not uploading.is_set():
            uploading.set()
            with pytest.raises(PushRefused, match=f"pid {os.getpid()} on {socket.gethostname()}") as error:
                push(qwen_run, FakeHub(tmp_path / "other hub"))
            refused.append(str(error.value))

    hub.before_commit = second_push
    first = threading.Thread(target=push, args=(qwen_run, hub))
    first.start()
    first.join()
    assert len(refused) == 1 and card_files(hub)  # the second refused, the first finished
    assert not RunLayout(qwen_run).push_lock.exists()


def test_the_lock_of_a_push_whose_process_is_gone_from_this_host_is_taken_over(qwen_run, tmp_path):
    run_dir = copy_of(qwen_run, tmp_path)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    hold_lock(run_dir, socket.gethostname(), gone.pid)
    hub = FakeHub(tmp_path / "hub")
    assert push(run_dir, hub).uploaded[-1] == CARD
    assert not RunLayout(run_dir).push_lock.exists()


def test_another_writer_moving_the_branch_during_the_push_is_refused(qwen_run, tmp_path):
    hub = FakeHub(tmp_path / "hub")
    hub.create_repo(REPO_ID, repo_type="dataset")
    hub.before_commit = lambda: hub._write(REPO_ID, "someone else's edit", {"notes.md": b"edited meanwhile\n"})
    with pytest.raises(PushRefused, match="its main branch moved during this push"):
        push(qwen_run, hub)
    assert repo_data_files(hub) == []


def test_a_damaged_shard_is_refused_by_name_before_any_commit(qwen_run, tmp_path):
    run_dir = copy_of(qwen_run, tmp_path)
    flipped, truncated = committed_shards(run_dir)[1:3]
    content = bytearray(flipped.read_bytes())
    content[len(content) // 2] ^= 0xFF  # same size: only its sha256 tells
    flipped.write_bytes(bytes(content))
    hub = FakeHub(tmp_path / "hub")
    with pytest.raises(PushRefused, match=f"data/{flipped.name} does not match its sha256 in the manifest"):
        push(run_dir, hub)
    assert len(hub.commits(REPO_ID)) == 1  # the repo's creation alone
    truncated.write_bytes(truncated.read_bytes()[:-10])
    with pytest.raises(PushRefused, match=re.escape(f"{truncated} has ") + r"\d+ bytes, its manifest says"):
        push(run_dir, hub)
    unreadable = committed_shards(run_dir)[0]
    content = bytearray(unreadable.read_bytes())
    content[-8:-4] = (len(content) * 2).to_bytes(4, "little")  # the footer's length, past the file's start
    unreadable.write_bytes(bytes(content))
    with pytest.raises(PushRefused, match=re.escape(f"{unreadable}: its Parquet footer does not read (")):
        push(run_dir, hub)
    assert len(hub.commits(REPO_ID)) == 1


def test_an_unfinished_run_is_refused_before_any_upload(qwen_run, tmp_path):
    run_dir = copy_of(qwen_run, tmp_path)
    RunLayout(run_dir).success.unlink()  # what a run still being written lacks
    hub = FakeHub(tmp_path / "hub")
    with pytest.raises(PushRefused, match="has no _SUCCESS: the run is unfinished or still being written"):
        push(run_dir, hub)
    assert REPO_ID not in hub.repos


@pytest.mark.parametrize("marker", [True, False], ids=["with-marker", "before-the-marker"])
def test_a_run_of_the_older_format_is_refused_naming_the_upgrade_as_the_readers_do(qwen_run, tmp_path, marker):
    """A run written before the output format had a version, with the marker or from before it: the push says what
    every reader says (upgrade the run), never that the folder is no run directory."""
    older = as_format_1(qwen_run, tmp_path / "qwen", marker)
    hub = FakeHub(tmp_path / "hub")
    with pytest.raises(PushRefused, match=r"written in output format 1; .*upgrade the run directory once with "
                                          r"`batchvlm-upgrade run_dir=<run>`"):
        push(older, hub)
    assert REPO_ID not in hub.repos


def png(pixels) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def test_a_run_with_later_occurrences_of_an_id_in_its_shards_is_published_without_them(tmp_path):
    images = [png(data.coffee()[::8, ::8]), png(data.chelsea()[::8, ::8])]
    files = {"a.parquet": ["a0", "shared", "a2", "a3"], "b.parquet": ["b0", "shared", "b2", "a3"]}  # b's repeat a's
    (tmp_path / "inputs").mkdir()
    for name, ids in files.items():
        rows = [{"id": record_id, "images": [images[i % 2]], "text": f"<image> {name} row {i}"}
                for i, record_id in enumerate(ids)]
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / "inputs" / name)
    run_dir = embed_in_process(tmp_path, "dups", "dataset=parquet", f"dataset.path={tmp_path}/inputs/*.parquet",
                               "dataset.unit_records=2")
    assert json.loads(RunLayout(run_dir).success.read_text())["duplicates"]["in_data"] == 2
    hub = FakeHub(tmp_path / "hub")
    first = push(run_dir, hub)
    records = list(read_run(run_dir))
    assert len(records) == 6  # each id once: the later occurrences left out
    assert_rows_are(datasets.load_dataset(str(hub.folder(REPO_ID)), split="train", cache_dir=str(tmp_path / "cache")),
                    records)
    assert "- 2 of the quarantined are later occurrences of an id" in (hub.folder(REPO_ID) / CARD).read_text()
    assert not RunLayout(run_dir).push_staging.exists()
    assert len(first.uploaded) == len(published_shards(RunLayout(run_dir))) + 1
    again = push(run_dir, hub)  # the copies without them are the same bytes again
    assert (again.uploaded, again.commits) == ([], [])
    copied = next(shard for shard in published_shards(RunLayout(run_dir)) if shard.skipped)
    flipped = RunLayout(run_dir).listed(copied.listing.path)
    content = bytearray(flipped.read_bytes())
    content[10] ^= 0xFF  # in its first page, of the same size: only its sha256 tells, checked before it is copied
    flipped.write_bytes(bytes(content))
    fresh = FakeHub(tmp_path / "fresh")
    with pytest.raises(PushRefused, match=re.escape(f"{flipped} does not match its sha256 in the manifest")):
        push(run_dir, fresh)
    assert REPO_ID not in fresh.repos and not RunLayout(run_dir).push_staging.exists()


def test_a_row_group_over_the_viewers_limit_is_named_with_its_shard(qwen_run):
    shard = committed_shards(qwen_run)[0]
    biggest = max(pq.read_metadata(shard).row_group(group).total_byte_size
                  for group in range(pq.read_metadata(shard).num_row_groups))
    assert oversized_row_groups(shard, pq.read_metadata(shard)) == []
    assert oversized_row_groups(shard, pq.read_metadata(shard), limit=biggest - 1) == [
        f"{shard}: row group 0 is {biggest:,} bytes in memory, over the dataset viewer's {biggest - 1:,}"]


def test_the_push_job_publishes_the_run_and_says_what_it_did(qwen_run, tmp_path, monkeypatch, capsys):
    import huggingface_hub

    from batchvlm.jobs.push import main

    hub = FakeHub(tmp_path / "hub")
    monkeypatch.setattr(huggingface_hub, "HfApi", lambda: hub)  # the job's own HfApi(), answered by the stand-in
    arguments = [f"run_dir={qwen_run}", f"repo_id={REPO_ID}", "license=cc-by-4.0"]
    monkeypatch.setattr(sys, "argv", ["batchvlm-push", *arguments])
    main()
    shards = len(published_shards(RunLayout(qwen_run)))
    assert capsys.readouterr().out.strip() == (f"OK {REPO_ID}: {shards} of {shards} data shards uploaded and the "
                                               "card in 2 commits")
    main()
    assert capsys.readouterr().out.strip() == (f"OK {REPO_ID}: already up to date ({shards} data shards and the "
                                               "card), nothing committed")
