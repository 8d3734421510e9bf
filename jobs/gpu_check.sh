#!/usr/bin/env bash
# The GPU check: one command on a machine with one CUDA GPU, as the device tool's machine is (its image has CUDA,
# torch and triton, and lacks what jobs/gpu_wheels.txt lists), in under 5 minutes:
#
#   bash jobs/gpu_check.sh --fetch-wheels   here, once: the wheels the image lacks into .whl/ (git-ignored)
#   bash jobs/gpu_check.sh --dry-run        here, on a CPU: every step up to the device (wheels listed, configs
#                                           checked, tasks imported, tests collected), nothing run on a GPU
#   bash jobs/gpu_check.sh                  there (the device tool's run, with carry [".whl"])
#
# Steps: the carried wheels installed (--no-deps) and batchvlm itself without its dependencies; versions and
# nvidia-smi; the kernel tests compiled for the GPU; preprocessing of all three families against their HF processors
# (speed and largest pixel difference); a bf16 base-size tower's images/s and achieved TFLOP/s; the job's images/s
# against its tower's on the same batches, overlap on and off, with its syncs per batch; nvJPEG against
# libjpeg-turbo on baseline, progressive, gray, 4:4:4 and EXIF-rotated JPEGs; the CUDA tests of the device loop.
# Each step runs under its own timeout; a failing step is reported and the next one runs; the summary at the end
# lists every step, and the script exits 1 if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
WHEELS=${BATCHVLM_WHEELS:-.whl}
SITE=${BATCHVLM_SITE:-/tmp/batchvlm-site}
PINS=jobs/gpu_wheels.txt
MODE=run
case "${1:-}" in
    --dry-run) MODE=dry ;;
    --fetch-wheels) MODE=fetch ;;
    "") ;;
    *) echo "usage: bash jobs/gpu_check.sh [--dry-run | --fetch-wheels]" >&2; exit 2 ;;
esac

pins() { sed -e 's/#.*//' -e '/^[[:space:]]*$/d' "$PINS" | awk '{print $1}'; }

# The pip download command of the device tool's README (CPython 3.12, manylinux x86-64); a package published as a
# source archive only is built into a wheel instead.
fetch_wheels() {
    mkdir -p "$WHEELS"
    local pin
    for pin in $(pins); do
        "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 -d "$WHEELS" "$pin" 2>/dev/null \
            || "$PYTHON" -m pip wheel -q --no-deps -w "$WHEELS" "$pin" || { echo "could not fetch $pin" >&2; return 1; }
    done
    ls -l "$WHEELS"
}

if [[ $MODE == fetch ]]; then
    fetch_wheels
    exit
fi

# A wheel's file name spells its distribution with underscores (hydra_core-1.3.8-py3-none-any.whl).
wheel_of() { local name=${1%%==*} version=${1##*==}; compgen -G "$WHEELS/${name//-/_}-$version-*.whl"; }

check_wheels() {
    local pin missing=()
    for pin in $(pins); do
        wheel_of "$pin" >/dev/null || missing+=("$pin")
    done
    if (( ${#missing[@]} )); then
        echo "missing from $WHEELS: ${missing[*]}; fetch them with: bash jobs/gpu_check.sh --fetch-wheels"
        return 1
    fi
    echo "every wheel of $PINS is in $WHEELS"
}

install() {
    check_wheels || return 1
    local wheels=()
    mapfile -t wheels < <(for pin in $(pins); do wheel_of "$pin"; done)
    if [[ $MODE == dry ]]; then
        echo "would run: $PYTHON -m pip install --no-index --no-deps --target $SITE ${wheels[*]}"
        echo "would run: $PYTHON -m pip install --no-index --no-deps --no-build-isolation -e ."
        return 0
    fi
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        "${wheels[@]}" || return 1
    # batchvlm itself, editable and without its dependencies: kernels/ becomes batchvlm.kernels (setup.py)
    "$PYTHON" -m pip install -q --no-index --no-deps --no-build-isolation -e .
}

versions() {
    "$PYTHON" - <<'PY'
import importlib.metadata as metadata
import platform

import torch

print(f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      + ", ".join(f"{name} {metadata.version(name)}" for name in
                  ("triton", "torchvision", "transformers", "datasets", "hydra-core", "pyarrow", "pillow", "batchvlm")))
if torch.cuda.is_available():
    print(f"device: {torch.cuda.get_device_name()}, {torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
else:
    print("no CUDA device")
PY
    if [[ $MODE == dry ]]; then
        echo "would run: nvidia-smi"
    else
        nvidia-smi
    fi
}

# A pytest step: collected only in a dry run.
tests() { "$PYTHON" -m pytest -q -p no:cacheprovider $([[ $MODE == dry ]] && echo --collect-only -q) "$@"; }
# A bench step: its config checked and its task imported only in a dry run.
bench() { "$PYTHON" jobs/bench.py "$@" $([[ $MODE == dry ]] && echo dry_run=true); }

DEVICE_TESTS="tests/test_devices.py tests/executor/test_overlap.py tests/pipeline/test_jpeg.py"
DEVICE_TESTS+=" tests/pipeline/test_encode.py tests/executor/test_device.py"
# name, timeout in seconds, command: the timeouts add up to under the device tool's 600 s per command; the steps
# are expected to take half of that.
STEPS=(
    "wheels|45|install"
    "versions|20|versions"
    "kernel tests (compiled)|80|tests tests/kernels/test_pack_pixels.py"
    "preprocess kimi_k25 vs HF|35|bench task=preprocess model=kimi_k25_tiny repeats=3"
    "preprocess qwen2_vl vs HF|35|bench task=preprocess model=qwen2_vl_tiny repeats=3"
    "preprocess siglip2 vs HF|35|bench task=preprocess model=siglip2_tiny repeats=3"
    "bf16 base tower TFLOP/s|50|bench task=tower records=64 repeats=3"
    "job vs tower, overlap on/off, syncs|110|bench task=e2e records=128 job_workers=8"
    "nvJPEG vs libjpeg-turbo|35|bench task=jpeg records=32"
    "CUDA tests of the device loop|150|tests $DEVICE_TESTS"
)

unset TRITON_INTERPRET  # compiled kernels, not interpreted
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export -f pins wheel_of check_wheels install versions tests bench
export PYTHON WHEELS SITE PINS MODE
results=()
failed=0
started=$SECONDS
for step in "${STEPS[@]}"; do
    IFS="|" read -r name limit command <<<"$step"
    echo "== $name (at most ${limit} s): $command"
    begin=$SECONDS
    # the install step sets nothing the others need: PYTHONPATH names the folder before it is filled
    timeout --kill-after=10 "$limit" bash -c "$command"
    status=$?
    took=$((SECONDS - begin))
    if (( status == 0 )); then
        verdict="ok"
    elif (( status == 124 || status == 137 )); then
        verdict="FAILED (timed out after $limit s)"
    else
        verdict="FAILED (exit $status)"
    fi
    [[ $verdict == ok ]] || failed=1
    results+=("$name: $verdict, ${took} s")
    echo "-- $name: $verdict, ${took} s"
done
echo "== summary ($MODE, $((SECONDS - started)) s)"
printf '%s\n' "${results[@]}"
exit $failed
