"""kernels/ installs as batchvlm.kernels and never passes for the PyPI `kernels` distribution, which
transformers probes for by import name (DESIGN.md, Layout)."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import importlib.util, json
import batchvlm, batchvlm.kernels, batchvlm.kernels.reference, batchvlm.kernels.taps
import transformers.utils
print(json.dumps({"kernels_spec": importlib.util.find_spec("kernels") is not None,
                  "is_kernels_available": transformers.utils.is_kernels_available(),
                  "file": batchvlm.kernels.__file__}))
"""


def test_batchvlm_kernels_does_not_shadow_the_kernels_distribution(tmp_path):
    # From a neutral folder, as an installed package is used: the repository root is not on sys.path.
    result = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["kernels_spec"] is False
    assert seen["is_kernels_available"] is False
    assert seen["file"].endswith("kernels/__init__.py")
