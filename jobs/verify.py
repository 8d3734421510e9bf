"""`python jobs/verify.py run_dir=outputs/<run>`: exit 0 if the run keeps its contract, 1 naming each problem."""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from batchvlm.verify import verify_run


@hydra.main(config_path="../conf", config_name="verify", version_base=None)
def main(cfg: DictConfig) -> None:
    run_dir = Path(cfg.run_dir)
    problems = verify_run(run_dir)
    for problem in problems:
        print(f"FAIL {problem}")
    if problems:
        sys.exit(1)
    print(f"OK {run_dir}: every unit committed, checksums and counts verified, no id twice")


if __name__ == "__main__":
    main()
