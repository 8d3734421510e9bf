"""jobs/gpu_check.sh rehearsed on the CPU (--dry-run): every step up to the device, each reported, the script going on
past a failing one."""

from __future__ import annotations

import subprocess

from conftest import REPO

STEPS = ["versions", "e2e base tower, 8 workers", "e2e base tower, 14 workers", "e2e tiny tower, 8 workers",
         "tower MFU per family", "preprocessing per family", "nvJPEG vs libjpeg-turbo", "CUDA tests"]
SCRIPT = REPO / "jobs" / "gpu_check.sh"


def step_limits() -> dict[str, int]:
    """Each step's timeout, as the script declares it."""
    steps = SCRIPT.read_text().split("STEPS=(")[1].split("\n)")[0]
    return {name: int(limit) for name, limit, _ in (line.strip().strip('"').split("|", 2)
                                                      for line in steps.strip().splitlines())}


def test_the_steps_timeouts_with_their_kill_after_fit_a_rerun_under_the_device_tools_cap():
    limits = step_limits()
    kill_after = int(SCRIPT.read_text().split("KILL_AFTER=")[1].split()[0])
    assert list(limits) == ["wheels", *STEPS]
    assert sum(limits.values()) + kill_after * len(limits) < 6 * 60


def test_an_unknown_option_is_refused():
    result = subprocess.run(["bash", "jobs/gpu_check.sh", "--fast"], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 2 and "usage: bash jobs/gpu_check.sh" in result.stderr
