"""The main job: `python jobs/embed.py [overrides]` (see README.md, "Configuration")."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import hydra
import transformers
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from batchvlm.config import ConfigError, register_schemas, to_job_config
from batchvlm.executor.job import JobAborted, QuarantineOverLimit, run_job, summarize

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
register_schemas()


@hydra.main(config_path="pkg://batchvlm.conf", config_name="embed", version_base=None)
def main(cfg: DictConfig) -> None:
    transformers.utils.logging.disable_progress_bar()
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        job = to_job_config(cfg)
        summary = run_job(job, run_dir)
    except (ConfigError, JobAborted) as error:
        _remove_if_empty(run_dir)
        if isinstance(error, QuarantineOverLimit):  # the run finished: its summary, then why it failed
            print(summarize(error.summary))
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    if summary is not None:  # rank 0 speaks for the job
        print(summarize(summary))


def _remove_if_empty(run_dir: Path) -> None:
    """Hydra makes the run directory before the config can be checked: a refused config leaves none behind."""
    with contextlib.suppress(OSError):  # not empty: the job ran (or an earlier run did), its files stay
        run_dir.rmdir()


if __name__ == "__main__":
    main()
