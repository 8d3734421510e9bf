#!/usr/bin/env bash
# The GPU check: one command on a machine with one CUDA GPU, as the device tool's machine is (its image has CUDA,
# torch and triton, and lacks what jobs/gpu_wheels.txt lists), in under 5 minutes:
#
#   bash jobs/gpu_check.sh --fetch-wheels   here, once: the wheels the image lacks into .whl/ (git-ignored)
#   bash jobs/gpu_check.sh --dry-run        here, on a CPU: every step up to the device (wheels listed, configs
#                                           checked, tasks imported, tests collected), nothing run on a GPU
#   bash jobs/gpu_check.sh                  there (the device tool's run, with carry [".whl"])
#
# Steps, the most valuable first: the carried wheels installed (--no-deps) and batchvlm itself without its
# dependencies; versions and nvidia-smi; the job against its tower, overlap on and off, decode.jpeg=device (and how far
# its embeddings are), the host ceiling (the job with a zero-cost device stage against the decode stage times the
# workers) and the syncs per batch, for the base tower at 8 and at 14 workers and the tiny tower at 8; the tower's
# model FLOPs utilization per family at its released size; preprocessing of all three families, triton vs torch vs
# their HF processors; nvJPEG against libjpeg-turbo on baseline, progressive, gray, 4:4:4 and EXIF-rotated JPEGs; the
# CUDA tests (the device loop, the rings, varlen attention, the kernels compiled, clips' frames through them). Each
# step runs under its own timeout, prints its figures as it ends, and a failing step is reported and the next one
# runs; the timeouts (and their kill-after) add up to under 6 minutes, so that a rerun fits the device tool's 10-minute
# cap; the summary at the end lists every step, and the script exits 1 if any failed.
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

# A pytest step: collected only in a dry run; in one process (pyproject's addopts would start two xdist workers on
# the one GPU, and the image has no pytest-xdist).
tests() { "$PYTHON" -m pytest -q -p no:cacheprovider -o addopts="-ra --strict-markers" $([[ $MODE == dry ]] && echo --collect-only -q) "$@"; }
# A bench step: its config checked and its task imported only in a dry run.
bench() { "$PYTHON" jobs/bench.py "$@" $([[ $MODE == dry ]] && echo dry_run=true); }
# A bench for each family (its tiny checkpoint's processor and plan), every one run: fails where one failed. A dry
# run checks the three configs in one Python (a Hydra sweep, its files in a folder of its own): the task's imports
# are the same for each family, and a start that imports torch costs seconds.
FAMILIES="kimi_k25_tiny qwen2_vl_tiny siglip2_tiny"
per_family() {
    local model sweep status=0
    if [[ $MODE == dry ]]; then
        sweep=$(mktemp -d)
        bench -m "$@" "model=${FAMILIES// /,}" "hydra.sweep.dir=$sweep" hydra.sweep.subdir=. || status=1
        rm -rf "$sweep"
        return $status
    fi
    for model in $FAMILIES; do
        bench "$@" model=$model || status=1
    done
    return $status
}

DEVICE_TESTS="tests/test_devices.py tests/executor/test_overlap.py tests/pipeline/test_jpeg.py"
DEVICE_TESTS+=" tests/pipeline/test_encode.py tests/executor/test_device.py tests/executor/test_transport.py"
DEVICE_TESTS+=" tests/towers/test_attention.py tests/kernels/test_pack_pixels.py tests/kernels/test_pack_frames.py"
DEVICE_TESTS+=" tests/executor/slow/test_device_demo.py tests/kernels/slow/test_kernels_against_reference.py"
DEVICE_TESTS+=" tests/kernels/slow/test_clip_frames_through_the_kernels.py"
E2E="task=e2e records=128 stages=false"
# name, timeout in seconds, command: the timeouts, with KILL_AFTER each, add up to under 6 minutes (test_gpu_check.py
# holds them to it); the steps take about two thirds of them.
KILL_AFTER=2
STEPS=(
    "wheels|20|install"
    "versions|10|versions"
    "e2e base tower, 8 workers|60|bench $E2E job_workers=8"
    "e2e base tower, 14 workers|45|bench $E2E job_workers=14"
    "e2e tiny tower, 8 workers|40|bench $E2E job_workers=8 tower=tiny"
    "tower MFU per family|50|per_family task=tower tower=released records=32 repeats=2"
    "preprocessing per family|45|per_family task=preprocess repeats=2"
    "nvJPEG vs libjpeg-turbo|20|bench task=jpeg records=16"
    "CUDA tests|50|tests $DEVICE_TESTS"
)

unset TRITON_INTERPRET  # compiled kernels, not interpreted
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export -f pins wheel_of check_wheels install versions tests bench per_family
export PYTHON WHEELS SITE PINS MODE FAMILIES
results=()
failed=0
started=$SECONDS
for step in "${STEPS[@]}"; do
    IFS="|" read -r name limit command <<<"$step"
    echo "== $name (at most ${limit} s): $command"
    begin=$SECONDS
    # the install step sets nothing the others need: PYTHONPATH names the folder before it is filled
    timeout --kill-after=$KILL_AFTER "$limit" bash -c "$command"
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
