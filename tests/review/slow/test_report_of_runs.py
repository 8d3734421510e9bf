"""The failure report of real runs: terminal summary and page agree with the quarantine shards, and the page works in
headless Chromium."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from batchvlm.review.report import build_report, summary_text
from batchvlm.review.html import render
from conftest import REPO, quarantine_rows, run_job_command

# the demo job, the report as a process and a browser
pytestmark = pytest.mark.slow


ARTIFACTS = REPO / "tests" / "artifacts"


CARD = re.compile(r'<article class="card" data-check="([^"]+)".*?<h3 class="id">([^<]+)</h3>', re.DOTALL)


def run_report(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    return run_job_command("report", f"run_dir={run_dir}", *overrides, timeout=300)


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
def test_page_of_the_demo_run_has_a_card_for_every_quarantined_id_with_its_check(demo_report):
    run_dir, _ = demo_report
    page = (run_dir / "report" / "index.html").read_text()
    cards = {record_id: check for check, record_id in CARD.findall(page)}
    assert cards == {row["id"]: row["check"] for row in quarantine_rows(run_dir)}
    assert len(cards) == 3


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


def test_page_is_self_contained(demo_report):
    page = (demo_report[0] / "report" / "index.html").read_text()
    assert "default-src 'none'" in page  # the browser itself refuses any network load
    assert not re.search(r'(src|href)="(?!data:)', page)
    assert "<mark>&lt;image&gt;</mark> and <mark>&lt;image&gt;</mark>" in page  # placeholders highlighted


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


def test_the_report_of_a_conversation_run_shows_roles_and_counts_the_cut_conversations(llava_run):
    report = build_report(llava_run, thumbnails=False)
    (card,) = report.cards["text.roles"]
    assert [turn["role"] for turn in card.row["turns"]] == ["assistant", "user"] and card.row["turn_index"] == 0
    assert report.cut_conversations[0] == 1 and report.cut_conversations[1] >= 2
    assert "conversations cut to whole turns (text.overflow=drop_turns): 1 records" in summary_text(report)
    assert 'data-role="assistant"' in render(report)


def test_a_json_lines_record_is_named_by_its_number_in_the_file_and_its_byte_not_a_row(tmp_path):
    from batchvlm.executor.config import JobConfig, RuntimeConfig
    from batchvlm.executor.tally import ChecksConfig
    from batchvlm.pipeline.decode import DecodeConfig
    from batchvlm.rundir.sink import OutputConfig
    from batchvlm.sources.config import dataset_config
    from batchvlm.executor.job import run_job

    Image.fromarray(np.zeros((28, 42, 3), np.uint8)).save(tmp_path / "black.png")
    bad = {7, 18, 25}
    lines = [json.dumps({"id": f"r{n}", "images": ["black.png"],
                         "text": ("<image><image> twice" if n in bad else "<image> once") + " x" * (n % 5)}) + "\n"
             for n in range(30)]
    lines.insert(10, "\n")  # a blank line is no record
    (tmp_path / "captions.jsonl").write_text("".join(lines))
    job = JobConfig(run_name="captions", output=OutputConfig(root=str(tmp_path)),
                    dataset=dataset_config("json", path=str(tmp_path / "captions.jsonl"), unit_bytes=400),
                    decode=DecodeConfig(isolation="none"), checks=ChecksConfig(max_quarantine_fraction=1),
                    runtime=RuntimeConfig(num_workers=0, progress=False))
    run_job(job, tmp_path / "captions")
    report = build_report(tmp_path / "captions", thumbnails=False)
    cards = sorted(report.cards["text.placeholder_count"], key=lambda card: card.row["row"])
    offsets = {json.loads(line)["id"]: sum(map(len, lines[:index])) for index, line in enumerate(lines) if line.strip()}
    assert len({card.row["unit"] for card in cards}) == 3  # in units after the first: counted over those before
    assert [(card.row["id"], card.record, card.row["row"]) for card in cards] == [
        (f"r{n}", n, offsets[f"r{n}"]) for n in sorted(bad)]
    page = render(report)
    assert f"record 18 · byte {offsets['r18']:,}" in page and f"row {offsets['r18']}" not in page
