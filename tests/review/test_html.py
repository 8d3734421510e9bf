"""The report page escapes what a dataset put in its records: a quarantined row is text on the page, never markup."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from batchvlm.review.html import render
from batchvlm.review.report import Card, Report

HOSTILE = '<script>alert("x")</script><img src=x onerror=alert(1)>'


def test_a_hostile_id_text_and_message_are_shown_as_text():
    row = {"id": HOSTILE, "source": "/data/a.parquet", "row": 3, "unit": "u", "stage": "decode",
           "check": "decode.unreadable", "message": HOSTILE, "expected": "an image", "observed": HOSTILE,
           "exception_type": "CheckFailed", "image_index": 0, "image_paths": [HOSTILE], "text": f"<image> {HOSTILE}",
           "fingerprint": "f"}
    report = Report(run_dir=Path("/runs/r"), complete=True, records_in=1, written=0, quarantined=1,
                    fallbacks=Counter(), max_cards_per_check=5, by_check=Counter({"decode.unreadable": 1}),
                    cards={"decode.unreadable": [Card(row, None, 0)]})
    page = render(report)
    assert HOSTILE not in page and "&lt;script&gt;" in page
    assert page.count("<script") == page.count("</script>")  # only the page's own scripts
