"""The library below the jobs, and the status and verify commands, import only what they need."""

from __future__ import annotations

import sys

import pytest

from test_config import CONF

# a process of its own each
pytestmark = pytest.mark.slow


def test_the_library_below_the_jobs_imports_without_hydra_omegaconf_or_datasets():
    """The schemas need neither; only the jobs load configs with them. So the kernels, the families and the stages
    import on an image that lacks them (the GPU check's kernel tests run even when its wheels failed to install)."""
    import subprocess
    import sys

    code = """
import sys
class Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("hydra", "omegaconf", "datasets"):
            raise ImportError(f"no {name} here")
sys.meta_path.insert(0, Absent())
import batchvlm.config, batchvlm.families.kimi_k25, batchvlm.families.qwen2_vl, batchvlm.families.siglip2
import batchvlm.kernels.pack_pixels, batchvlm.pipeline.preprocess, batchvlm.pipeline.encode, batchvlm.pipeline.jpeg
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_status_and_verify_commands_start_without_importing_torch():
    """They read a run's metadata alone, from a login node as often as not: a second, not the 2-5 s of torch."""
    import subprocess

    code = """
import runpy, sys
for job in ("status", "verify"):
    runpy.run_path(f"jobs/{job}.py")  # the command's own imports; its main is not called
print(sorted(name for name in sys.modules if name.split(".")[0] in ("torch", "transformers", "datasets")))
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=CONF.parent, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"
