"""Measuring before and around a job: the benchmarks, measured side by side in one run (tasks.py: task=preprocess,
task=loader; scale.py: task=scale; e2e.py: task=e2e). Sizing a job from a sample of its input is
batchvlm.sizing.estimate's."""

import sys

EMBED_JOB = [sys.executable, "-m", "batchvlm.jobs.embed"]
"""The installed embed job as a command. Run it with a folder of its own as the working directory: `-m` puts that
folder first on the path, and in a source checkout the top-level kernels/ would pass for the PyPI `kernels`."""
