"""The reader turns rows back into tensors: bf16 bit for bit, no copy, spans aligned with embeddings, only from
the shards a manifest lists, of a finished run, each what its manifest says."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from rows import CURRENT_FORMAT, data_row

from batchvlm.format.schema import DATA_SCHEMA
from batchvlm.pipeline.assemble import embed_bytes
from batchvlm.training.reader import read_run, read_shard, row_group_of, row_group_starts, run_layouts, trusted_shards


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


def _fake_run(folder, fingerprint: dict, requeue_from=None):
    """A run directory as far as choosing the runs to read together looks: its fingerprint, its lineage."""
    folder.mkdir(parents=True)
    (folder / "fingerprint.json").write_text(json.dumps(fingerprint))
    if requeue_from is not None:
        (folder / "lineage.json").write_text(json.dumps({"requeue_from": str(requeue_from), "requeued": []}))
    return folder


# -- every reader reads the same records, of a finished run, from files that are what their manifests say ------------
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
