"""The README is the front door: it lists every check and the commands CI runs."""

from __future__ import annotations

from pathlib import Path

from batchvlm.checks import CATALOGUE, markdown_table

REPO = Path(__file__).resolve().parents[1]


def test_readme_lists_every_check():
    readme = (REPO / "README.md").read_text()
    missing = [name for name in CATALOGUE if f"`{name}`" not in readme]
    assert missing == []
    assert markdown_table() in readme  # regenerate with `python -m batchvlm.checks`


def test_ci_installs_and_tests_exactly_as_the_readme_says():
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    for command in ("python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[dev]'", "python -m pytest"):
        assert command in readme and command in ci
