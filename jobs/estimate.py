"""`python jobs/estimate.py [overrides]`: how much output, how long and how much bandwidth the embed job of the same
overrides needs, from a sample of its input (batchvlm/sizing/estimate.py)."""

from __future__ import annotations

import os

import transformers
from omegaconf import DictConfig

from batchvlm.config import exit_on_config_error, job_main, to_job_config
from batchvlm.executor.config import register_schemas
from batchvlm.sizing.estimate import EstimateConfig, estimate, format_estimate

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
register_schemas("estimate_schema", EstimateConfig)


@job_main("estimate")
def main(cfg: DictConfig) -> None:
    transformers.utils.logging.disable_progress_bar()
    with exit_on_config_error():
        result = estimate(to_job_config(cfg, EstimateConfig))
    print(format_estimate(result))


if __name__ == "__main__":
    main()
