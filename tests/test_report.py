"""The failure report: terminal summary and page agree with the quarantine shards, the page works in a
real browser, it stays capped and complete on 100k quarantined rows, and requeue re-runs only the
quarantined records into a new run, with lineage."""

from __future__ import annotations

import io
import json
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from batchvlm.format.schema import QUARANTINE_SCHEMA
from batchvlm.config import ConfigError, DatasetConfig, DecodeConfig, JobConfig, OutputConfig, RuntimeConfig
from batchvlm.executor.job import run_job
from batchvlm.review.report import build_report, summary_text
from batchvlm.review.html import render
from batchvlm.sources.requeue import quarantined_records, requeue_source
from batchvlm.rundir.verify import verify_run
from conftest import REPO, run_embed

ARTIFACTS = REPO / "tests" / "artifacts"
CARD = re.compile(r'<article class="card" data-check="([^"]+)".*?<h3 class="id">([^<]+)</h3>', re.DOTALL)


def run_report(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "jobs" / "report.py"), f"run_dir={run_dir}", *overrides],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


def quarantine_rows(run_dir: Path) -> list[dict]:
    return [row for path in sorted((run_dir / "quarantine").glob("*.parquet"))
            for row in pq.read_table(path, columns=["id", "check", "stage", "source"]).to_pylist()]


def data_ids(run_dir: Path) -> set[str]:
    return {row["id"] for path in (run_dir / "data").glob("*.parquet") for row in pq.read_table(path, columns=["id"]).to_pylist()}


def summary_section(summary: str, title: str) -> dict[str, int]:
    """`title:` followed by `  <count>  <key>` lines, as the terminal summary prints them."""
    lines = summary.splitlines()
    counts = {}
    for line in lines[lines.index(f"{title}:") + 1:]:
        if not line.startswith("  "):
            break
        count, key = line.split(None, 1)
        counts[key] = int(count)
    return counts


@pytest.fixture(scope="module")
def demo_report(demo_run, tmp_path_factory) -> tuple[Path, str]:
    """jobs/report.py on a copy of the demo run (the shared demo run stays as the job left it)."""
    run_dir = tmp_path_factory.mktemp("report") / "demo"
    shutil.copytree(demo_run, run_dir)
    result = run_report(run_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir, result.stdout


# -- the demo run ------------------------------------------------------------------------------
@pytest.mark.slow
def test_page_of_the_demo_run_has_a_card_for_every_quarantined_id_with_its_check(demo_report):
    run_dir, _ = demo_report
    page = (run_dir / "report" / "index.html").read_text()
    cards = {record_id: check for check, record_id in CARD.findall(page)}
    assert cards == {row["id"]: row["check"] for row in quarantine_rows(run_dir)}
    assert len(cards) == 3


@pytest.mark.slow
def test_terminal_summary_counts_equal_the_quarantine_shards(demo_report):
    run_dir, summary = demo_report
    rows = quarantine_rows(run_dir)
    success = json.loads((run_dir / "_SUCCESS").read_text())
    assert (f"records in: {success['records_in']}  written: {success['written']}  quarantined: {len(rows)}  "
            "fallbacks: 0") in summary
    assert summary_section(summary, "by check") == Counter(row["check"] for row in rows)
    assert summary_section(summary, "by stage") == Counter(row["stage"] for row in rows)
    assert summary_section(summary, "by source file") == Counter(row["source"] for row in rows)
    assert sum(summary_section(summary, "most frequent messages").values()) == len(rows)


@pytest.mark.slow
def test_report_describes_the_written_data_from_the_data_shards(demo_report):
    run_dir, summary = demo_report
    table = pq.read_table(run_dir / "data", columns=["input_ids", "image_num_tokens"])
    lengths = [len(ids) for ids in table.column("input_ids").to_pylist()]
    tokens = [n for per_image in table.column("image_num_tokens").to_pylist() for n in per_image]
    line = {key.strip(): value for key, value in
            (row.split("p50", 1) for row in summary.split("written data", 1)[1].splitlines()[1:4])}
    assert line["sequence length (tokens)"].endswith(f"max {max(lengths):,}  ({len(lengths)} records)")
    assert line["tokens per image"].endswith(f"max {max(tokens):,}  ({len(tokens)} images)")
    page = (run_dir / "report" / "index.html").read_text()
    assert page.count('<figure class="hist">') == 3


@pytest.mark.slow
def test_page_is_self_contained(demo_report):
    page = (demo_report[0] / "report" / "index.html").read_text()
    assert "default-src 'none'" in page  # the browser itself refuses any network load
    assert not re.search(r'(src|href)="(?!data:)', page)
    assert "<mark>&lt;image&gt;</mark> and <mark>&lt;image&gt;</mark>" in page  # placeholders highlighted


@pytest.mark.slow
def test_report_of_a_folder_that_is_no_run_fails_with_exit_2(tmp_path):
    result = run_report(tmp_path / "nowhere")
    assert result.returncode == 2
    assert "not a batchvlm run directory" in result.stderr


def _chromium_page(playwright):
    """A page in Debian's chromium; missing, the test fails (CI installs it) rather than skip unseen."""
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.fail("Debian's chromium is not installed: run `apt-get install -y chromium` (.ci/run does it)")
    browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
    return browser, browser.new_page(viewport={"width": 1280, "height": 900})


@pytest.mark.slow
def test_page_in_headless_chromium_shows_thumbnails_and_filters_by_check(demo_report):
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("playwright is missing: pip install -e '.[dev]'")
    run_dir, _ = demo_report
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as playwright:
        browser, page = _chromium_page(playwright)
        errors = []
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.goto((run_dir / "report" / "index.html").as_uri())
        cards = page.locator("article.card")
        assert cards.count() == 3 and all(cards.nth(i).is_visible() for i in range(3))
        thumbnail = page.locator("article.card img.thumbnail")
        assert thumbnail.count() == 1  # the only demo failure whose image decodes safely
        assert thumbnail.evaluate("img => img.complete && img.naturalWidth > 0")
        assert page.locator("article.card .placeholder").count() == 2  # truncated, not an image
        assert "grid_thw 1x" in page.locator("article.card figcaption").nth(2).inner_text()
        page.screenshot(path=str(ARTIFACTS / "report-demo.png"), full_page=True)

        page.select_option("#filter-check", "decode.truncated")
        visible = [cards.nth(i).locator("h3.id").inner_text() for i in range(3) if cards.nth(i).is_visible()]
        assert visible == ["bad_truncated_jpeg"]
        assert page.locator("#shown").inner_text() == "1 of 3 cards shown"
        page.screenshot(path=str(ARTIFACTS / "report-demo-filtered.png"), full_page=True)

        page.select_option("#filter-check", "")
        page.fill("#search", "web page")
        visible = [cards.nth(i).locator("h3.id").inner_text() for i in range(3) if cards.nth(i).is_visible()]
        assert visible == ["bad_not_an_image"]
        browser.close()
    assert errors == []


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
            "image_index": [0] * rows_per_shard, "image_bytes": [[png]] * rows_per_shard,
            "image_paths": [[None]] * rows_per_shard, "text": [f"<image> caption {i}" for i in rows],
            "fingerprint": ["f"] * rows_per_shard}, schema=QUARANTINE_SCHEMA)
        pq.write_table(table, run_dir / "quarantine" / f"{unit}.parquet")
        manifest = {"unit": unit, "records_in": rows_per_shard, "written": 0, "quarantined": rows_per_shard,
                    "files": {"quarantine": {"path": f"quarantine/{unit}.parquet"}}}
        (run_dir / "manifest" / f"{unit}.json").write_text(json.dumps(manifest))
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


# -- requeue -----------------------------------------------------------------------------------
def _job(root: Path, name: str, **fields) -> JobConfig:
    return JobConfig(run_name=name, output=OutputConfig(root=str(root)), runtime=RuntimeConfig(num_workers=0, progress=False),
                     **fields)


@pytest.mark.slow
def test_requeue_after_raising_the_pixel_limit_moves_those_records_into_data_with_lineage(tmp_path):
    run_job(_job(tmp_path, "small", decode=DecodeConfig(max_pixels=100_000)), tmp_path / "small")
    too_big = {row["id"] for row in quarantine_rows(tmp_path / "small") if row["check"] == "decode.too_many_pixels"}
    assert len(too_big) > 5

    requeue = _job(tmp_path, "small-requeue", requeue_from=str(tmp_path / "small"), check="decode.too_many_pixels")
    new_run = tmp_path / "small-requeue"
    run_job(requeue, new_run)
    assert verify_run(new_run) == []
    written, still = data_ids(new_run), {row["id"]: row["check"] for row in quarantine_rows(new_run)}
    assert written | set(still) == too_big  # only the requeued records, each exactly once
    assert still == {"bad_truncated_jpeg": "decode.truncated"}  # within the limit now, and truncated all along
    lineage = json.loads((new_run / "lineage.json").read_text())
    assert lineage["requeue_from"] == str((tmp_path / "small").resolve())
    assert {e["id"]: e["check"] for e in lineage["requeued"]} == {i: "decode.too_many_pixels" for i in too_big}

    report = build_report(new_run, thumbnails=False)
    assert {e["id"] for e in report.requeue.fixed} == written
    assert [e["now_check"] for e in report.requeue.still_quarantined] == ["decode.truncated"]
    assert "requeued from decode.too_many_pixels" in render(report)  # the card of the one still quarantined

    units = (new_run / "units.json").read_text()
    for path in (new_run / "manifest").glob("*.json"):  # as if it crashed before these commits
        path.unlink()
    (new_run / "_SUCCESS").unlink()
    run_job(requeue, new_run)  # resumes: the same units, every requeued record once
    assert (new_run / "units.json").read_text() == units and verify_run(new_run) == []
    assert data_ids(new_run) == written


@pytest.mark.slow
def test_requeue_into_the_run_it_reads_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="requeue_from=.*is the run directory of this job"):
        requeue_source(_job(tmp_path, "same", requeue_from=str(tmp_path / "same")), tmp_path / "same")


def _png(seed: int) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (40, 56, 3), np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def _write_parquet(path: Path, rows: list[tuple[str, str]]) -> None:
    features = datasets.Features({"id": datasets.Value("string"), "images": datasets.List(datasets.Image()),
                                  "text": datasets.Value("string")})
    table = {"id": [i for i, _ in rows], "images": [[{"bytes": _png(n), "path": None}] for n in range(len(rows))],
             "text": [text for _, text in rows]}
    datasets.Dataset.from_dict(table, features=features).to_parquet(str(path))


@pytest.mark.slow
def test_requeue_reads_the_fixed_text_from_the_dataset_and_reports_records_gone_from_it(tmp_path):
    dataset = tmp_path / "captions.parquet"
    _write_parquet(dataset, [("cat", "<image> a cat"), ("twice", "<image> and again <image>"),
                             ("gone", "<image><image>"), ("cup", "<image> a cup")])
    run_job(_job(tmp_path / "out", "captions", dataset=DatasetConfig(kind="parquet", path=str(dataset))),
            tmp_path / "out" / "captions")
    assert {row["id"]: row["check"] for row in quarantine_rows(tmp_path / "out" / "captions")} == {
        "twice": "text.placeholder_count", "gone": "text.placeholder_count"}

    # the text is fixed, a row is added before it (so its row moves) and "gone" is dropped
    _write_parquet(dataset, [("new", "<image> not quarantined before"), ("cat", "<image> a cat"),
                             ("twice", "<image> once now"), ("cup", "<image> a cup")])
    result = run_embed("runtime.progress=false", f"output.root={tmp_path / 'out'}", "dataset=parquet",
                       f"dataset.path={dataset}", f"requeue_from={tmp_path / 'out' / 'captions'}")
    assert result.returncode == 0, result.stderr[-3000:]
    new_run = tmp_path / "out" / "captions-requeue"  # the default run_name of a requeue
    assert data_ids(new_run) == {"twice"} and quarantine_rows(new_run) == []
    lineage = json.loads((new_run / "lineage.json").read_text())
    assert [(e["id"], e["from_row"], e["row"], e["matched_by"]) for e in lineage["requeued"]] == [("twice", 1, 2, "id")]
    assert [e["id"] for e in lineage["not_found"]] == ["gone"]
    assert "1 records, fixed: 1  still quarantined: 0  not found: 1" in summary_text(build_report(new_run))


@pytest.mark.slow
def test_check_selects_by_name_and_an_unknown_name_fails_naming_the_key(tmp_path):
    assert JobConfig(requeue_from="x", check="decode.truncated, text.placeholder_count").check == [
        "decode.truncated", "text.placeholder_count"]
    assert JobConfig(requeue_from="x", check=["encode.finite"]).check == ["encode.finite"]
    with pytest.raises(ConfigError, match=r"check='decode\.nope'.*decode\.nope is not a check"):
        JobConfig(requeue_from="x", check="decode.nope")
    with pytest.raises(ConfigError, match="requeue_from"):
        JobConfig(check="decode.truncated")
    with pytest.raises(ConfigError, match="requeue_from=.*not a batchvlm run directory"):
        quarantined_records(tmp_path, None)
