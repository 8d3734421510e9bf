#!/usr/bin/env bash
# The GPU check, one command on a machine with one CUDA GPU (under 5 minutes):
#   bash jobs/gpu_check.sh
# 1. the kernel tests compiled for the GPU (not interpreted): kernels vs their torch reference, the
#    triton backend's checks and CPU fallback; 2. the preprocessing benchmark, triton vs torch vs HF;
# 3. the e2e bench: overlap on vs off, decode.jpeg=device, and the decode stage both ways (safe CPU path vs
#    nvJPEG in batches, images/s and the largest pixel difference in levels); 4. the device loop's tests on
#    CUDA: the side stream and pinned copies, nvJPEG turning images upright, and the demo with overlap and
#    decode.jpeg=device against batch by batch on the safe path (last, so a failure leaves the figures).
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: this is the GPU check')"
unset TRITON_INTERPRET
python -m pytest -q tests/kernels/test_pack_pixels.py
python jobs/bench.py task=preprocess
python jobs/bench.py task=e2e records=128
python -m pytest -q tests/executor/test_overlap.py tests/pipeline/test_jpeg.py tests/executor/test_device.py tests/pipeline/test_encode.py
