"""The reader over real runs: bf16 bit for bit without a copy, spans aligned with embeddings, clips' grids, and damaged
or unfinished runs refused."""

from __future__ import annotations

import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import committed_shards

from batchvlm.training.reader import read_run, table_tensors, tensors_of

# runs of the job
pytestmark = pytest.mark.slow


def test_reader_views_the_arrow_buffer_without_copying(demo_run):
    path = sorted((demo_run / "data").glob("*.parquet"))[0]
    table = pq.read_table(path)
    record = tensors_of(table, 0)
    data = table.column("image_embeds").chunks[0].buffers()[2]
    assert data.address <= record.image_embeds.data_ptr() < data.address + data.size


def test_demo_rows_read_back_with_consistent_spans_grids_and_embeddings(demo_run):
    records = list(read_run(demo_run))
    assert len(records) == 18
    for record in records:
        tokens = int((record.grid_thw[:, 1] * record.grid_thw[:, 2] // 4).sum()) if len(record.grid_thw) else 0
        assert record.image_embeds.shape[0] == tokens == int(record.image_spans[:, 1].sum() if tokens else 0)
        assert len(record.token_tags) == len(record.input_ids)
        assert torch.isfinite(record.image_embeds.float()).all()
        positions = record.image_token_positions()
        assert (record.token_tags[positions] == 1).all() and int((record.token_tags == 1).sum()) == tokens


def test_a_shard_converted_whole_gives_the_rows_read_one_by_one(qwen_run):
    table = pq.read_table(committed_shards(qwen_run)[0])
    for index, whole in enumerate(table_tensors(table)):
        alone = tensors_of(table, index)
        assert whole.id == alone.id and whole.rope_delta == alone.rope_delta
        for name in ("input_ids", "image_embeds", "grid_thw", "image_spans", "token_tags", "position_ids"):
            assert torch.equal(getattr(whole, name), getattr(alone, name)), name
        assert whole.position_ids.shape == (3, len(whole.input_ids)) and whole.image_spans.shape[1] == 2


def test_a_table_in_several_chunks_gives_the_tensors_of_each_chunk(qwen_run):
    table = pq.read_table(committed_shards(qwen_run)[0])
    halves = table_tensors(pa.concat_tables([table, table.slice(1)]))
    for whole, alone in zip(halves, table_tensors(table) + table_tensors(table.slice(1)), strict=True):
        assert whole.id == alone.id
        for name in ("input_ids", "image_embeds", "image_spans", "token_tags", "position_ids"):
            assert torch.equal(getattr(whole, name), getattr(alone, name)), name


def test_each_clips_grid_and_time_step_are_read_as_the_shard_stores_them(clip_run):
    """video_grid_thw (int64 [n_clips, 3]) and second_per_grid_ts (float64 [n_clips]) beside video_spans, equal to
    the columns as pyarrow gives them; a record without clips has neither; a table in several chunks reads the same."""
    table = pq.read_table(committed_shards(clip_run)[0])
    stored = table.select(["id", "video_grid_thw", "second_per_grid_ts"]).to_pylist()
    records = table_tensors(table)
    assert sum(record.video_grid_thw is not None for record in records) == 3
    for record, row in zip(records, stored, strict=True):
        assert record.id == row["id"]
        if row["video_grid_thw"] is None:
            assert record.video_grid_thw is None and record.second_per_grid_ts is None and record.video_spans is None
            continue
        assert record.video_grid_thw.dtype == torch.int64 and record.video_grid_thw.tolist() == row["video_grid_thw"]
        assert record.video_grid_thw.shape == (len(record.video_spans), 3)
        assert record.second_per_grid_ts.dtype == torch.float64
        assert record.second_per_grid_ts.tolist() == row["second_per_grid_ts"]
    chunked = table_tensors(pa.concat_tables([table.slice(0, 2), table.slice(2)]))
    for whole, alone in zip(chunked, records, strict=True):
        for name in ("video_grid_thw", "second_per_grid_ts"):
            ours, theirs = getattr(whole, name), getattr(alone, name)
            assert (ours is None and theirs is None) or torch.equal(ours, theirs), (whole.id, name)


# -- every reader reads the same records, of a finished run, from files that are what their manifests say ------------
def damaged_copy(run, tmp_path, damage) -> tuple:
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    shard = committed_shards(copy)[0]
    data = bytearray(shard.read_bytes())
    shard.write_bytes(damage(data))
    return copy, shard


def test_an_unfinished_run_is_read_only_when_asked(demo_run, tmp_path):
    from batchvlm.training import PackedLoader, RunNotFinished, load_run_dataset

    copy = tmp_path / "copy"
    shutil.copytree(demo_run, copy)
    (copy / "_SUCCESS").unlink()
    for read in (lambda: list(read_run(copy)), lambda: load_run_dataset(copy), lambda: PackedLoader(copy)):
        with pytest.raises(RunNotFinished, match="allow_unfinished=True"):
            read()
    assert len(list(read_run(copy, allow_unfinished=True))) == len(list(read_run(demo_run)))


def test_a_shard_that_changed_size_is_refused_by_every_reader_naming_it(demo_run, tmp_path):
    from batchvlm.rundir.manifest import DamagedFile
    from batchvlm.training import PackedLoader, load_run_dataset

    copy, shard = damaged_copy(demo_run, tmp_path, lambda data: bytes(data[:-100]))
    for read in (lambda: list(read_run(copy)), lambda: load_run_dataset(copy), lambda: PackedLoader(copy)):
        with pytest.raises(DamagedFile, match=shard.name):
            read()


def test_a_flipped_bit_is_caught_by_the_readers_when_asked_to_check_checksums(demo_run, tmp_path):
    from batchvlm.rundir.manifest import DamagedFile

    def flip(data: bytearray) -> bytes:
        data[len(data) // 2] ^= 0x10  # inside the embeddings' pages: same size, other values
        return bytes(data)

    copy, shard = damaged_copy(demo_run, tmp_path, flip)
    assert len(list(read_run(copy))) == 18  # a size check alone cannot see it
    with pytest.raises(DamagedFile, match=f"{shard.name} does not match its sha256"):
        list(read_run(copy, checksums=True))
    from batchvlm.training import LoaderConfig, PackedLoader, load_run_dataset

    for read in (lambda: load_run_dataset(copy, checksums=True),
                 lambda: PackedLoader(copy, LoaderConfig(checksums=True, num_workers=0))):
        with pytest.raises(DamagedFile, match=f"{shard.name} does not match its sha256"):
            read()
