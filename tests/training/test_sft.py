"""PackedSFTTrainer: TRL's SFTTrainer on batchvlm's packed loader. Oracles: one step's loss through TRL's own loss
(its fused LM head) is the model's loss on model_inputs of the loader's first batch (item 1's), per family with a
language model; TRL's logged num_tokens after N steps is the number of tokens the N packed batches hold (TRL's own
count of such a batch, shown here, is 1); a batch without labels, and the options that would act on data the loader
has already prepared, are refused by name; the documented recipe runs as written."""

from __future__ import annotations

import ast
import importlib
import sys

import pytest
from conftest import REPO


trl = pytest.importorskip("trl")  # the dev extra installs it; the package itself never imports it


def imported_names(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    return [node.module or ""] if isinstance(node, ast.ImportFrom) else []


def test_only_the_recipe_module_imports_trl_and_without_trl_it_says_how_to_get_it(monkeypatch):
    importing = sorted({path.relative_to(REPO).as_posix() for path in (REPO / "batchvlm").rglob("*.py")
                        for node in ast.walk(ast.parse(path.read_text()))
                        if any(name.split(".")[0] == "trl" for name in imported_names(node))})
    assert importing == ["batchvlm/training/sft.py"]
    monkeypatch.setitem(sys.modules, "trl", None)  # as if it were not installed
    monkeypatch.delitem(sys.modules, "batchvlm.training.sft")
    with pytest.raises(ImportError, match="pip install trl"):
        importlib.import_module("batchvlm.training.sft")

