"""The demo's output reads with the oldest pyarrow it promises."""

from __future__ import annotations

import pytest

# the demo job, and an environment with the oldest pyarrow
pytestmark = pytest.mark.slow


def test_the_demo_output_reads_with_the_oldest_pyarrow_it_promises(demo_run):
    """With BATCHVLM_PYARROW_FLOOR naming a Python whose pyarrow is the oldest the output promises (15), every shard
    of the demo run reads back with it, as a trainer on that pyarrow would read it."""
    import os
    import subprocess

    floor = os.environ.get("BATCHVLM_PYARROW_FLOOR")
    if not floor:
        pytest.skip("set BATCHVLM_PYARROW_FLOOR to a python with pyarrow==15 (python -m venv v; v/bin/pip install "
                    "pyarrow==15.0.2 'numpy<2')")
    script = ("import sys, glob, pyarrow as pa, pyarrow.parquet as pq\n"
              "paths = sorted(glob.glob(sys.argv[1] + '/*/*.parquet'))\n"
              "print(pa.__version__, sum(pq.read_table(p).num_rows for p in paths))")
    result = subprocess.run([floor, "-c", script, str(demo_run)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    version, rows = result.stdout.split()
    assert version.startswith("15.") and int(rows) > 0
