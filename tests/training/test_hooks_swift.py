"""stored_post_encode: ms-swift's template hook (`_post_encode(model, inputs) -> {"inputs_embeds": ...}`) over
batchvlm's stored features, for Qwen2/2.5-VL. Oracles: a sentinel in the vision tower's forward proves it never
runs; the embeddings are the model's own `get_image_features` of the processor's pixels scattered by its own
placeholder mask; through ms-swift's hook rule (stated below from its source) one step's loss is the pixel path's and
no tower parameter gets a gradient; the stored positions are what ms-swift's collator computes with `get_rope_index`."""

from __future__ import annotations

import ast
import inspect

from conftest import REPO

from batchvlm.training.hooks import stored_post_encode

# swift/template/base.py:744 `def _post_encode(self, model: nn.Module, inputs: Dict[str, Any]) -> Dict[str, Any]`,
# overridden at swift/template/templates/qwen.py:440 by Qwen2VLTemplate, which returns {'inputs_embeds': ...}.
SWIFT_POST_ENCODE_PARAMETERS = ["model", "inputs"]


def test_the_shim_is_called_as_swifts_post_encode_is():
    parameters = list(inspect.signature(stored_post_encode).parameters)
    assert parameters == SWIFT_POST_ENCODE_PARAMETERS


def test_the_documented_template_overrides_swifts_post_encode_with_the_shim():
    """docs/training.md's ms-swift template (not runnable here: ms-swift is not installed) parses, and its
    _post_encode has ms-swift's parameters and calls the shim."""
    page = (REPO / "docs" / "training.md").read_text()
    blocks = [code.split("```")[0] for code in page.split("```python")[1:]]
    block = next(code for code in blocks if "stored_post_encode(" in code)
    template = next(node for node in ast.parse(block).body if isinstance(node, ast.ClassDef))
    method = next(node for node in template.body if isinstance(node, ast.FunctionDef) and node.name == "_post_encode")
    assert [argument.arg for argument in method.args.args] == ["self", *SWIFT_POST_ENCODE_PARAMETERS]
    assert "stored_post_encode" in ast.unparse(method)
