"""The reader turns rows back into tensors: bf16 bit for bit, no copy, spans aligned with embeddings, only from
the shards a manifest lists, of a finished run, each what its manifest says."""

from __future__ import annotations

import json
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import committed_shards
from rows import CURRENT_FORMAT, data_row

from batchvlm.format.schema import DATA_SCHEMA
from batchvlm.pipeline.assemble import embed_bytes
from batchvlm.training.reader import (read_run, read_shard, row_group_of, row_group_starts, run_layouts, table_tensors,
                                      tensors_of, trusted_shards)


@pytest.mark.parametrize("dtype,name", [(torch.bfloat16, "bfloat16"), (torch.float16, "float16"),
                                        (torch.float32, "float32")])
def test_reader_round_trips_embeddings_bit_for_bit(tmp_path, dtype, name):
    generator = torch.Generator().manual_seed(0)
    embeds = [torch.randn(5, 24, generator=generator).to(dtype), torch.randn(3, 24, generator=generator).to(dtype)]
    embeds[0][0, 0] = -0.0
    row = data_row(id="r", source="s", row=0, text="t", input_ids=list(range(10)),
                   image_spans=[{"start": 1, "length": 5}, {"start": 7, "length": 3}], token_tags=[0] * 10,
                   num_tokens=10, grid_thw=[[1, 2, 10], [1, 2, 6]], original_size=[[1, 1], [1, 1]],
                   resized_size=[[1, 1], [1, 1]], image_sha256=["a", "b"], image_num_tokens=[5, 3],
                   num_image_tokens=8, image_embeds=embed_bytes(embeds, dtype, 24))
    table = pa.Table.from_pylist([row], schema=DATA_SCHEMA).replace_schema_metadata(
        {b"batchvlm.embed_dtype": name.encode(), b"batchvlm.hidden_size": b"24", **CURRENT_FORMAT})
    pq.write_table(table, tmp_path / "shard.parquet")
    (record,) = read_shard(tmp_path / "shard.parquet")
    stored = torch.cat(embeds)
    assert record.image_embeds.dtype == dtype and record.image_embeds.shape == (8, 24)
    assert torch.equal(record.image_embeds.view(torch.uint8), stored.view(torch.uint8))
    assert record.image_token_positions().tolist() == [1, 2, 3, 4, 5, 7, 8, 9]


def test_a_rows_group_is_found_from_the_footer_and_a_row_past_the_shard_has_none(tmp_path):
    """The one rule the loader, the export and StoredImages find a row's group by."""
    path = tmp_path / "groups.parquet"
    pq.write_table(pa.table({"row": list(range(10))}), path, row_group_size=4)
    starts = row_group_starts(pq.ParquetFile(path))
    assert starts.tolist() == [0, 4, 8, 10]
    assert [row_group_of(starts, row) for row in (0, 3, 4, 7, 8, 9, 10, -1)] == [0, 0, 1, 1, 2, 2, None, None]
    for row in range(10):  # each row is in the group found, at its offset from the group's start
        group = row_group_of(starts, row)
        assert pq.ParquetFile(path).read_row_group(group).column("row")[row - starts[group]].as_py() == row


@pytest.mark.slow
def test_reader_views_the_arrow_buffer_without_copying(demo_run):
    path = sorted((demo_run / "data").glob("*.parquet"))[0]
    table = pq.read_table(path)
    record = tensors_of(table, 0)
    data = table.column("image_embeds").chunks[0].buffers()[2]
    assert data.address <= record.image_embeds.data_ptr() < data.address + data.size


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_shard_converted_whole_gives_the_rows_read_one_by_one(qwen_run):
    table = pq.read_table(committed_shards(qwen_run)[0])
    for index, whole in enumerate(table_tensors(table)):
        alone = tensors_of(table, index)
        assert whole.id == alone.id and whole.rope_delta == alone.rope_delta
        for name in ("input_ids", "image_embeds", "grid_thw", "image_spans", "token_tags", "position_ids"):
            assert torch.equal(getattr(whole, name), getattr(alone, name)), name
        assert whole.position_ids.shape == (3, len(whole.input_ids)) and whole.image_spans.shape[1] == 2


@pytest.mark.slow
def test_a_table_in_several_chunks_gives_the_tensors_of_each_chunk(qwen_run):
    table = pq.read_table(committed_shards(qwen_run)[0])
    halves = table_tensors(pa.concat_tables([table, table.slice(1)]))
    for whole, alone in zip(halves, table_tensors(table) + table_tensors(table.slice(1)), strict=True):
        assert whole.id == alone.id
        for name in ("input_ids", "image_embeds", "image_spans", "token_tags", "position_ids"):
            assert torch.equal(getattr(whole, name), getattr(alone, name)), name


@pytest.mark.slow
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


@pytest.mark.slow
def test_an_unfinished_run_is_read_only_when_asked(demo_run, tmp_path):
    from batchvlm.training import PackedLoader, RunNotFinished, load_run_dataset

    copy = tmp_path / "copy"
    shutil.copytree(demo_run, copy)
    (copy / "_SUCCESS").unlink()
    for read in (lambda: list(read_run(copy)), lambda: load_run_dataset(copy), lambda: PackedLoader(copy)):
        with pytest.raises(RunNotFinished, match="allow_unfinished=True"):
            read()
    assert len(list(read_run(copy, allow_unfinished=True))) == len(list(read_run(demo_run)))


@pytest.mark.slow
def test_a_shard_that_changed_size_is_refused_by_every_reader_naming_it(demo_run, tmp_path):
    from batchvlm.rundir.manifest import DamagedFile
    from batchvlm.training import PackedLoader, load_run_dataset

    copy, shard = damaged_copy(demo_run, tmp_path, lambda data: bytes(data[:-100]))
    for read in (lambda: list(read_run(copy)), lambda: load_run_dataset(copy), lambda: PackedLoader(copy)):
        with pytest.raises(DamagedFile, match=shard.name):
            read()


@pytest.mark.slow
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


def _fake_run(folder, fingerprint: dict, requeue_from=None):
    """A run directory as far as choosing the runs to read together looks: its fingerprint, its lineage."""
    folder.mkdir(parents=True)
    (folder / "fingerprint.json").write_text(json.dumps(fingerprint))
    if requeue_from is not None:
        (folder / "lineage.json").write_text(json.dumps({"requeue_from": str(requeue_from), "requeued": []}))
    return folder


def test_runs_read_together_are_a_run_and_its_requeue_runs_of_one_fingerprint(tmp_path):
    run = _fake_run(tmp_path / "llava", {"family": "qwen2_vl"})
    requeue = _fake_run(tmp_path / "llava-requeue", {"family": "qwen2_vl"}, requeue_from=run)
    again = _fake_run(tmp_path / "llava-requeue-requeue", {"family": "qwen2_vl"}, requeue_from=requeue)
    assert [layout.root for layout in run_layouts([run, requeue, again])] == [run, requeue, again]
    assert [layout.root for layout in run_layouts(run)] == [run]
    other = _fake_run(tmp_path / "other", {"family": "qwen2_vl"})
    with pytest.raises(ValueError, match="other is not a requeue run .*each after the run it requeued"):
        run_layouts([run, other])
    with pytest.raises(ValueError, match="llava-requeue-requeue requeued .*llava-requeue, which is not before it"):
        run_layouts([run, again])
    with pytest.raises(ValueError, match="llava is not a requeue run"):
        run_layouts([requeue, run])
    tiny = _fake_run(tmp_path / "tiny-requeue", {"family": "kimi_k25"}, requeue_from=run)
    with pytest.raises(ValueError, match="another fingerprint .*family: 'qwen2_vl' -> 'kimi_k25'"):
        run_layouts([run, tiny])


def test_a_run_dir_that_is_a_file_is_refused_naming_it_for_every_reader(tmp_path):
    """read_run, the serving requests and the export take a run directory: a file given there is named, never an
    OSError from inside the run's layout."""
    from batchvlm.training.serving import serving_requests

    file = tmp_path / "notes.txt"
    file.write_text("a user's file")
    for read in (lambda: list(read_run(file)), lambda: list(serving_requests(file, "vllm")),
                 lambda: trusted_shards([file])):
        with pytest.raises(ValueError, match=rf"^{file} is a file, not a run directory"):
            read()
    assert file.read_text() == "a user's file"
