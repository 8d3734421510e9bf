"""`python jobs/status.py run_dir=outputs/<run> [format=json]`: where a run stands, from any node, while it runs
(batchvlm/review/status.py): units committed out of total, records, quarantined by check, bytes written, the rate and
the ETA, and each rank's heartbeat, units held and whether it is stale. Exit 0; 2 on a bad run_dir or format."""

from __future__ import annotations

import dataclasses
import json

from omegaconf import DictConfig

from batchvlm.config import ConfigError, exit_on_config_error, job_main, required_path
from batchvlm.review.status import format_status, run_status


@job_main("status")
def main(cfg: DictConfig) -> None:
    with exit_on_config_error():
        run_dir = required_path(cfg, "run_dir", "run_dir=outputs/<run>")
        if cfg.format not in ("text", "json"):
            raise ConfigError(f"format must be one of text, json, not {cfg.format!r}")
        status = run_status(run_dir)
    if cfg.format == "json":
        print(json.dumps(dataclasses.asdict(status), default=str, indent=1))
    else:
        print(format_status(status))


if __name__ == "__main__":
    main()
