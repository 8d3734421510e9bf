"""The README is the front door (short, with the commands CI runs); docs/ holds the rest (the table of every check),
and every relative link between them leads somewhere."""

from __future__ import annotations

import re
from pathlib import Path

from batchvlm.checks import CATALOGUE, markdown_table

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but hyphens dropped, spaces as hyphens."""
    headings = re.findall(r"^#{1,6} (.+)$", FENCE.sub("", page.read_text()), re.M)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


def broken_links(page: Path, root: Path = REPO) -> list[str]:
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in anchors(linked)):
            broken.append(f"{page.relative_to(root)}: {target}")
    return broken


def test_the_checks_page_lists_every_check_as_the_catalogue_prints_it():
    checks = (REPO / "docs" / "checks.md").read_text()
    missing = [name for name in CATALOGUE if f"`{name}`" not in checks]
    assert missing == []
    assert markdown_table() in checks  # regenerate with `python -m batchvlm.checks`


def test_ci_installs_and_tests_exactly_as_the_readme_says():
    readme = README.read_text()
    ci = (REPO / ".ci" / "run").read_text()
    for command in ("python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[dev]'", "python -m pytest"):
        assert command in readme and command in ci


def test_the_readme_stays_a_front_door_of_at_most_16_kb():
    assert len(README.read_bytes()) <= 16 * 1024


def test_every_relative_link_of_the_readme_and_the_docs_leads_to_a_file_and_heading_that_exist():
    assert len(PAGES) > 1
    assert [broken for page in PAGES for broken in broken_links(page)] == []


def test_a_broken_link_and_a_missing_anchor_are_found(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other page\n\n## Adding a family\n")
    page.write_text("# Page\n\n[ok](other.md#adding-a-family) [file](gone.md) [anchor](other.md#nowhere) "
                    "[self](#page) [web](https://example.org)\n\n```\n[in code](ignored.md)\n```\n")
    assert broken_links(page, tmp_path) == ["page.md: gone.md", "page.md: other.md#nowhere"]

