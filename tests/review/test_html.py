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


def test_a_quarantined_conversation_shows_its_roles_and_where_it_was_cut():
    turns = [{"role": "user", "text": "<image> Describe it."}, {"role": "assistant", "text": "A rocket."},
             {"role": "user", "text": f"More? {HOSTILE}"}, {"role": "assistant", "text": "Long answer."}]
    row = {"id": "long", "source": "/data/llava.json", "row": 120, "unit": "u", "stage": "text",
           "check": "text.too_long", "message": "900 tokens, more than text.max_tokens=400; turn 2 (user) ends at 410",
           "expected": "<= 400 tokens", "observed": "900 tokens", "exception_type": "CheckFailed", "image_index": None,
           "image_paths": ["/data/img/rocket.jpg"], "text": "[...]", "turns": turns, "turn_index": 2,
           "fingerprint": "f"}
    report = Report(run_dir=Path("/runs/r"), complete=True, records_in=1, written=0, quarantined=1,
                    fallbacks=Counter(), max_cards_per_check=5, by_check=Counter({"text.too_long": 1}),
                    cards={"text.too_long": [Card(row, None, 0)]})
    page = render(report)
    roles = page.split('id="cards"')[1]
    assert [part.split('"')[0] for part in roles.split('data-role="')[1:]] == ["user", "assistant", "user", "assistant"]
    cut = roles.index("✂ text.max_tokens is reached in this turn")
    assert roles.index("A rocket.") < cut < roles.index("More?")
    assert "4 turn(s), 1 × &lt;image&gt; for 1 image(s)" in roles
    assert HOSTILE not in page
