"""Package discovery, the one thing pyproject.toml cannot say: every sub-package under batchvlm/ is found, and the
top-level kernels/, conf/ and jobs/ folders (DESIGN.md) install inside it. Everything else is in pyproject.toml."""

from setuptools import find_packages, setup

TOP_LEVEL = {"batchvlm.kernels": "kernels", "batchvlm.conf": "conf", "batchvlm.jobs": "jobs"}

setup(packages=find_packages(include=["batchvlm", "batchvlm.*"]) + list(TOP_LEVEL), package_dir=TOP_LEVEL)
