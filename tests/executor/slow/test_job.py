"""The embed job end to end on the embedded demo, as a new user runs it."""

from __future__ import annotations

import json

import datasets
import pyarrow.parquet as pq
import pytest

from batchvlm.demo import demo_rows
from batchvlm.executor.tally import QuarantineOverLimit
from conftest import embed_in_process, run_embed, summary_in_process

# the job as a subprocess, on the demo and on small datasets
pytestmark = pytest.mark.slow

EXPECTED_QUARANTINE = {
    "bad_truncated_jpeg": "decode.truncated",
    "bad_not_an_image": "decode.unreadable",
    "bad_placeholder_count": "text.placeholder_count",
}


def _ids(run_dir, kind):
    return [row["id"] for path in sorted((run_dir / kind).glob("*.parquet"))
            for row in pq.read_table(path, columns=["id"]).to_pylist()]


def test_every_demo_id_lands_in_exactly_one_of_data_and_quarantine(demo_run):
    written, quarantined = _ids(demo_run, "data"), _ids(demo_run, "quarantine")
    input_ids = [row["id"] for row in demo_rows()]
    assert sorted(written + quarantined) == sorted(input_ids)
    assert len(set(written + quarantined)) == len(input_ids)


def test_bad_demo_records_are_quarantined_under_their_check(demo_run):
    rows = [row for path in (demo_run / "quarantine").glob("*.parquet") for row in pq.read_table(path).to_pylist()]
    assert {row["id"]: row["check"] for row in rows} == EXPECTED_QUARANTINE
    for row in rows:
        assert row["message"] and row["expected"] and row["observed"] and row["stage"] == row["check"].split(".")[0]
        assert row["fingerprint"] and row["source"].endswith(".parquet")
    truncated = next(row for row in rows if row["id"] == "bad_truncated_jpeg")
    assert truncated["image_index"] == 0 and truncated["image_bytes"][0][:2] == b"\xff\xd8"


def test_run_directory_follows_the_output_contract(demo_run):
    for name in ("config.yaml", "fingerprint.json", "_SUCCESS"):
        assert (demo_run / name).exists(), name
    manifests = [json.loads(p.read_text()) for p in sorted((demo_run / "manifest").glob("*.json"))]
    assert len(manifests) == 4  # two Parquet files of 11 and 10 rows, unit_records 6
    for manifest in manifests:
        assert manifest["records_in"] == manifest["written"] + manifest["quarantined"]
        for entry in (entry for entries in manifest["files"].values() for entry in entries):
            assert pq.read_metadata(demo_run / entry["path"]).num_rows == entry["rows"]
    success = json.loads((demo_run / "_SUCCESS").read_text())
    assert (success["records_in"], success["written"], success["quarantined"]) == (21, 18, 3)
    assert not [p for p in demo_run.rglob("*") if ".tmp-" in p.name]


def test_shards_open_with_datasets_and_pyarrow(demo_run):
    files = sorted(str(p) for p in (demo_run / "data").glob("*.parquet"))
    loaded = datasets.load_dataset("parquet", data_files=files, split="train")
    assert len(loaded) == 18
    assert set(loaded.column_names) >= {"id", "input_ids", "image_spans", "token_tags", "grid_thw", "image_embeds"}
    table = pq.read_table(files[0])
    meta = table.schema.metadata
    assert meta[b"batchvlm.embed_dtype"] == b"bfloat16" and int(meta[b"batchvlm.hidden_size"]) > 0
    assert meta[b"batchvlm.family"] == b"kimi_k25"


def test_text_only_and_placeholderless_records_are_written(demo_run):
    rows = {row["id"]: row for path in (demo_run / "data").glob("*.parquet") for row in pq.read_table(path).to_pylist()}
    assert rows["text_only"]["num_image_tokens"] == 0 and rows["text_only"]["image_embeds"] == b""
    moon = rows["moon_no_placeholder"]  # images but no placeholder: prepended by the default policy
    assert len(moon["image_spans"]) == 1 and moon["image_spans"][0]["start"] > 0


def test_rerun_of_a_finished_run_writes_nothing(demo_run):
    before = {p: p.stat().st_mtime_ns for p in demo_run.rglob("*") if p.is_file() and p.suffix != ".log"}
    result = run_embed(f"output.root={demo_run.parent}", "run_name=demo")
    assert result.returncode == 0, result.stderr[-3000:]
    after = {p: p.stat().st_mtime_ns for p in before}
    changed = [p.name for p in before if before[p] != after[p]]
    assert changed == []


def test_a_small_run_that_quarantined_more_than_the_limit_ends_non_zero_and_so_does_its_rerun(tmp_path):
    """Under checks.min_records the limit cannot stop a running job; the finished run is judged by its totals."""
    overrides = (f"output.root={tmp_path}", "run_name=strict", "checks.max_quarantine_fraction=0.1")
    result = run_embed(*overrides)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "records in: 21  written: 18  quarantined: 3" in result.stdout
    assert "3 of 21 records quarantined (14.3%), over checks.max_quarantine_fraction=0.1" in result.stderr
    assert (tmp_path / "strict" / "_SUCCESS").exists()  # complete and committed: a rerun writes nothing
    with pytest.raises(QuarantineOverLimit) as rerun:  # in this process: what the job exits 2 for, as above
        summary_in_process(tmp_path, "strict", "checks.max_quarantine_fraction=0.1")
    assert (rerun.value.summary["written"], rerun.value.summary["quarantined"]) == (18, 3)


def test_a_siglip2_job_stores_patch_tokens_and_one_pooled_vector_per_image(tmp_path):
    from batchvlm.training.reader import read_run

    records = [r for r in read_run(embed_in_process(tmp_path, "s", "model=siglip2_tiny")) if len(r.grid_thw)]
    assert len(records) >= 15
    for record in records:
        assert record.image_embeds.shape[0] == int(record.grid_thw.prod(-1).sum())
        assert record.extras["pooled_embeds"].shape == (len(record.grid_thw), record.image_embeds.shape[1])
        assert record.position_ids is None
