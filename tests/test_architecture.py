"""The package's layout is its architecture (docs/design.md): a module imports only from its own room or the rooms below
it, and one module spells the run directory's paths."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "batchvlm"
ROOMS = {
    # the bottom: typed records, the check catalogue, the config schemas, the Parquet contract
    "records": 0, "checks": 0, "config": 0, "faults": 0, "devices": 0, "demo": 0, "format": 0, "towers": 0,
    "families": 1, "kernels": 1,
    "pipeline": 2,
    "rundir": 3,
    "sources": 4,
    "executor": 5, "review": 5, "training": 5,
    "bench": 6, "sizing": 6, "publish": 6,
    "jobs": 7,
}
"""Each room's level: it may import from rooms of a lower level and from itself, never from another of its own level
but at the bottom, whose modules are the vocabulary of the rest (config names checks, checks build records)."""
TOP_LEVEL = {"batchvlm.kernels": REPO / "kernels", "batchvlm.jobs": REPO / "jobs"}


def may_import(room: str, other: str) -> bool:
    level, other_level = ROOMS[room], ROOMS[other]
    return other == room or other_level < level or other_level == level == 0


def room_of(module: str) -> str:
    """`batchvlm.rundir.sink` -> rundir, `batchvlm.config` -> config."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def imported_modules(path: Path) -> set[str]:
    """Every batchvlm module a file imports, at its top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("batchvlm"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("batchvlm.")}
    return found


def modules() -> dict[str, Path]:
    """Every module of the package, by its dotted name (kernels/ and jobs/ install inside it)."""
    found = {}
    for package, folder in {"batchvlm": PACKAGE, **TOP_LEVEL}.items():
        for path in folder.rglob("*.py"):
            relative = path.relative_to(folder).with_suffix("")
            found[".".join([package, *relative.parts]).removesuffix(".__init__")] = path
    return found


def test_every_module_lives_in_a_room_of_the_architecture():
    assert {room_of(name) for name in modules()} - {""} == set(ROOMS)


def test_a_module_imports_only_from_its_own_room_or_rooms_below():
    upward = []
    for name, path in sorted(modules().items()):
        room = room_of(name)
        if not room:
            continue  # batchvlm/__init__.py: the package's public names, from any room
        for imported in imported_modules(path):
            other = room_of(imported)
            if other and not may_import(room, other):
                upward.append(f"{name} ({room}) imports {imported} ({other})")
    assert upward == []


def test_only_the_run_layout_spells_the_run_directory():
    spelled = [str(path.relative_to(REPO)) for path in PACKAGE.rglob("*.py")
               if '"manifest"' in (text := path.read_text()) or "_SUCCESS" in text]
    assert spelled == ["batchvlm/rundir/layout.py"]


def test_the_code_cites_no_file_outside_the_repository():
    """Docstrings and comments cite papers and repositories, or the repository's own docs/: a reader of the code has
    neither the project's reference folder nor its design notes."""
    outside = ("shared/reference", "DESIGN.md", "reference/families.md", "reference/conversations.md")
    citing = [f"{path.relative_to(REPO)}: {needle}" for folder in (PACKAGE, *TOP_LEVEL.values(), REPO / "tests")
              for path in folder.rglob("*.py") for needle in outside if needle in path.read_text()
              and path != Path(__file__)]
    assert citing == []
