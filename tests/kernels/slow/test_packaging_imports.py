"""Pythons of their own import the PyPI `kernels` distribution, never batchvlm's kernels/ folder."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata

import pytest

from conftest import REPO

# a process of its own each
pytestmark = pytest.mark.slow


PROBE = """
import importlib.util, json
import batchvlm, batchvlm.kernels, batchvlm.kernels.reference, batchvlm.kernels.taps
import transformers.utils
from transformers import Kimi_K25ForConditionalGeneration  # its activations import the kernels distribution
spec = importlib.util.find_spec("kernels")
print(json.dumps({"kernels_origin": spec.origin if spec else None,
                  "is_kernels_available": transformers.utils.is_kernels_available(),
                  "file": batchvlm.kernels.__file__}))
"""


def distribution_installed(name: str) -> bool:
    try:
        metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return False
    return True


def test_batchvlm_kernels_does_not_shadow_the_kernels_distribution(tmp_path):
    # From a neutral folder, as an installed package is used: the repository root is not on sys.path.
    result = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    installed = distribution_installed("kernels")
    assert (seen["kernels_origin"] is not None) == installed == seen["is_kernels_available"]
    assert seen["kernels_origin"] is None or not seen["kernels_origin"].startswith(str(REPO / "kernels"))
    assert seen["file"].endswith("kernels/__init__.py")


FROM_THE_ROOT = """
import json, kernels
from kernels import CUDAProperties  # what transformers' hub_kernels imports as it loads a model
import batchvlm.kernels.reference
print(json.dumps({"kernels": kernels.__file__, "reference": batchvlm.kernels.reference.__file__}))
"""


def test_python_run_in_the_checkouts_root_imports_the_kernels_distribution_not_the_folder():
    # `python -c` (or a notebook) started in the root puts the root first on sys.path, beside the kernels/ folder.
    result = subprocess.run([sys.executable, "-c", FROM_THE_ROOT], cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert not seen["kernels"].startswith(str(REPO / "kernels"))
    assert seen["reference"] == str(REPO / "kernels" / "reference.py")
