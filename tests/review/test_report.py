"""The failure report: terminal summary and page agree with the quarantine shards, the page works in a
real browser, and it stays capped and complete on 100k quarantined rows."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from batchvlm.format.schema import QUARANTINE_SCHEMA
from batchvlm.review.report import build_report, summary_text
from batchvlm.review.html import render
from batchvlm.rundir.manifest import Listing, Manifest


# -- size --------------------------------------------------------------------------------------
def _tiny_png() -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.full((8, 8, 3), 200, np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def _synthetic_run(run_dir: Path, shards: int, rows_per_shard: int, checks: list[str]) -> None:
    """A run directory with only quarantine shards and their manifests, rows in QUARANTINE_SCHEMA."""
    for name in ("data", "quarantine", "manifest"):
        (run_dir / name).mkdir(parents=True)
    png = _tiny_png()
    for shard in range(shards):
        unit = f"synthetic-{shard:04d}"
        rows = range(shard * rows_per_shard, (shard + 1) * rows_per_shard)
        table = pa.Table.from_pydict({
            "id": [f"r{i}" for i in rows], "source": [f"/data/part-{shard % 3}.parquet"] * rows_per_shard,
            "row": list(rows), "unit": [unit] * rows_per_shard,
            "check": [checks[i % len(checks)] for i in rows], "stage": [checks[i % len(checks)].split(".")[0] for i in rows],
            "message": [f"failure kind {i % 7}" for i in rows], "expected": ["1"] * rows_per_shard,
            "observed": ["2"] * rows_per_shard, "exception_type": ["CheckFailed"] * rows_per_shard,
            "image_index": [0] * rows_per_shard, "video_index": [None] * rows_per_shard, "video_paths": [None] * rows_per_shard, "image_bytes": [[png]] * rows_per_shard,
            "image_paths": [[None]] * rows_per_shard, "text": [f"<image> caption {i}" for i in rows],
            "turns": [None] * rows_per_shard, "turn_index": [None] * rows_per_shard,
            "fingerprint": ["f"] * rows_per_shard}, schema=QUARANTINE_SCHEMA)
        pq.write_table(table, run_dir / "quarantine" / f"{unit}.parquet")
        listing = Listing(f"quarantine/{unit}.parquet", rows_per_shard, 0, "")
        manifest = Manifest(unit, "input", rows.start, rows.stop, rows_per_shard, 0, rows_per_shard, {},
                            {"quarantine": [listing]}, rank=0, claim="a0")
        (run_dir / "manifest" / f"{unit}.json").write_text(json.dumps(manifest.to_json()))
    (run_dir / "_SUCCESS").write_text(json.dumps({"fallbacks": {"preprocess.grid_match": 7}}))


def test_report_of_100k_quarantined_rows_caps_cards_per_check_and_counts_every_row(tmp_path):
    checks = ["decode.truncated", "decode.unreadable", "text.placeholder_count", "encode.finite", "decode.timeout"]
    _synthetic_run(tmp_path / "big", shards=10, rows_per_shard=10_000, checks=checks)
    started = time.perf_counter()
    report = build_report(tmp_path / "big", max_cards_per_check=20)
    page = render(report)
    seconds = time.perf_counter() - started
    print(f"report of 100k quarantined rows: {seconds:.2f} s, page {len(page) / 1e6:.2f} MB")
    assert report.quarantined == 100_000 and report.fallbacks == {"preprocess.grid_match": 7}
    assert report.by_check == {check: 20_000 for check in checks}
    assert {check: len(cards) for check, cards in report.cards.items()} == {check: 20 for check in checks}
    assert page.count('<article class="card"') == 100
    assert page.count("19,980 more records quarantined under") == len(checks)
    thumbnails = [t for cards in report.cards.values() for card in cards for t in card.thumbnails]
    assert sum(t.data_uri is not None for t in thumbnails) == 80  # the decode.timeout images are never decoded
    assert "fallbacks: 7\n" in summary_text(report) and "7  fell back on preprocess.grid_match" in summary_text(report)
