#!/usr/bin/env bash
# The GPU check, one command on a machine with one CUDA GPU (well under 5 minutes):
#   bash jobs/gpu_check.sh
# 1. the kernel tests compiled for the GPU (not interpreted): kernels vs their torch reference, the
#    triton backend's checks and CPU fallback; 2. the preprocessing benchmark, triton vs torch vs HF.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: this is the GPU check')"
unset TRITON_INTERPRET
python -m pytest -q tests/test_kernels.py
python jobs/bench.py task=preprocess
