"""Duplicate ids across files and ranks: found at the end in hash partitions, the first occurrence kept."""

from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image
from skimage import data

from batchvlm.rundir.dedup import duplicate_rows
from batchvlm.rundir.layout import RunLayout
from batchvlm.training.reader import read_run
from batchvlm.training.interop import load_run_dataset
from batchvlm.training.loader import RunIndex, epoch_order
from batchvlm.review.report import build_report
from batchvlm.rundir.verify import verify_run
from conftest import refused_in_process, run_ranks

# the job as two ranks and as a process
pytestmark = pytest.mark.slow


def _png(pixels) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


IMAGES = [_png(data.coffee()[::8, ::8]), _png(data.chelsea()[::8, ::8]), _png(data.rocket()[::8, ::8])]
FILES = {  # file -> ids in row order; "shared" and "twice" repeat across files, "inside" within one unit
    "a.parquet": ["a0", "shared", "a2", "twice", "a4", "a5"],
    "b.parquet": ["b0", "twice", "shared", "inside", "inside", "b5"],
}


def _write(folder) -> None:
    for name, ids in FILES.items():
        rows = [{"id": record_id, "images": [IMAGES[i % 3]], "text": f"<image> {name} row {i}"}
                for i, record_id in enumerate(ids)]
        pq.write_table(pa.Table.from_pylist(rows), folder / name)


def test_duplicates_across_two_files_and_two_ranks_keep_the_first_occurrence(tmp_path):
    _write(tmp_path)
    results = run_ranks(f"output.root={tmp_path}", "run_name=dups", "dataset=parquet",
                        f"dataset.path={tmp_path}/*.parquet", "dataset.unit_records=3", "runtime.num_workers=1",
                        "runtime.dedup_buckets=3", "runtime.poll_s=0.2")
    assert [result.returncode for result in results] == [0, 0], results[0].stderr[-4000:] + results[1].stderr[-4000:]
    run_dir = tmp_path / "dups"
    assert {json.loads(p.read_text())["rank"] for p in (run_dir / "manifest").glob("*.json")} == {0, 1}

    later = sorted((d["id"], d["source"].rsplit("/", 1)[-1], d["row"], d["kind"]) for d in duplicate_rows(RunLayout(run_dir)))
    assert later == [("inside", "b.parquet", 4, "quarantine"),  # quarantined within its unit as it was read
                     ("shared", "b.parquet", 2, "data"), ("twice", "b.parquet", 1, "data")]
    kept = {record.id: record for record in read_run(run_dir)}
    assert sorted(kept) == sorted(set(FILES["a.parquet"] + FILES["b.parquet"]))  # every id once
    quarantine = pq.read_table(next((run_dir / "quarantine").glob("*.parquet"))).to_pylist()
    assert [(row["id"], row["check"], row["row"]) for row in quarantine] == [("inside", "source.duplicate_id", 4)]
    stored = {(row["source"].rsplit("/", 1)[-1], row["id"]): row["input_ids"] for path in (run_dir / "data").glob("*.parquet")
              for row in pq.read_table(path, columns=["id", "source", "input_ids"]).to_pylist()}
    for record_id in ("shared", "twice"):  # both copies sit in shards (their texts differ); the reader keeps a's
        assert stored[("a.parquet", record_id)] != stored[("b.parquet", record_id)]
        assert kept[record_id].input_ids.tolist() == stored[("a.parquet", record_id)]

    success = json.loads((run_dir / "_SUCCESS").read_text())
    assert success["by_check"] == {"source.duplicate_id": 3}
    assert (success["records_in"], success["written"], success["quarantined"]) == (12, 9, 3)
    assert success["duplicates"] == {"later_occurrences": 3, "in_data": 2}
    assert verify_run(run_dir) == []
    index = RunIndex.of(run_dir)  # the training loader reads what read_run reads
    assert len(epoch_order(index, seed=0, epoch=0, buffer=4)) == len(kept) == 9
    loaded = load_run_dataset(run_dir, cache_dir=str(tmp_path / "cache"))  # and so does `datasets`
    assert sorted(loaded["id"]) == sorted(kept)
    assert {(row["id"], row["source"].rsplit("/", 1)[-1]) for row in loaded.select_columns(["id", "source"])} >= {
        ("shared", "a.parquet"), ("twice", "a.parquet")}

    # refused by the job's own steps in this process (its exit 2: test_refusals_of_the_job.py)
    refused = refused_in_process(tmp_path, "dataset=parquet", f"dataset.path={tmp_path}/*.parquet",
                                 f"requeue_from={run_dir}", "runtime.num_workers=0")
    # its one quarantined record is a later occurrence of an id the run holds
    assert "nothing to requeue" in refused and "already written in its data" in refused
    assert verify_run(run_dir) == []  # the run it read is left whole
    report = build_report(run_dir, thumbnails=False)
    assert report.by_check["source.duplicate_id"] == 3 and report.written == 9
    assert sorted(card.row["id"] for card in report.cards["source.duplicate_id"]) == ["inside", "shared", "twice"]
