"""`python jobs/bench.py task=preprocess|scale`: measurements side by side in one run (batchvlm/bench.py)."""

from __future__ import annotations

import os
import sys

import hydra
import transformers
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from batchvlm.bench import BenchConfig, bench_preprocess, format_preprocess
from batchvlm.bench_scale import bench_scale, format_scale
from batchvlm.config import ConfigError

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ConfigStore.instance().store(name="bench_schema", node=BenchConfig)


@hydra.main(config_path="pkg://batchvlm.conf", config_name="bench", version_base=None)
def main(cfg: DictConfig) -> None:
    transformers.utils.logging.disable_progress_bar()
    try:
        config = OmegaConf.to_object(cfg)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    if config.task == "scale":
        print(format_scale(bench_scale(config.rows, config.files, config.rss_records, config.first_unit_records)))
    else:
        print(format_preprocess(bench_preprocess(config)))


if __name__ == "__main__":
    main()
