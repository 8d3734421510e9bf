"""`python jobs/verify.py run_dir=outputs/<run>`: exit 0 if the run keeps its contract, 1 naming each problem."""

from __future__ import annotations

import sys

from omegaconf import DictConfig

from batchvlm.config import exit_on_config_error, job_main, required_path
from batchvlm.rundir.verify import run_counts, verify_run


@job_main("verify")
def main(cfg: DictConfig) -> None:
    with exit_on_config_error():
        run_dir = required_path(cfg, "run_dir", "run_dir=outputs/<run>")
    problems = verify_run(run_dir)
    for problem in problems:
        print(f"FAIL {problem}")
    if problems:
        sys.exit(1)
    print(f"OK {run_dir}: {run_counts(run_dir)}; every unit committed, checksums and counts verified, no id twice")


if __name__ == "__main__":
    main()
