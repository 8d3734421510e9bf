"""`python jobs/bench.py task=preprocess`: triton vs torch vs the family's HF processor, in one run."""

from __future__ import annotations

import os
import sys

import hydra
import transformers
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from batchvlm.bench import BenchConfig, bench_preprocess, format_preprocess
from batchvlm.config import ConfigError

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ConfigStore.instance().store(name="bench_schema", node=BenchConfig)


@hydra.main(config_path="pkg://batchvlm.conf", config_name="bench", version_base=None)
def main(cfg: DictConfig) -> None:
    transformers.utils.logging.disable_progress_bar()
    try:
        result = bench_preprocess(OmegaConf.to_object(cfg))
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    print(format_preprocess(result))


if __name__ == "__main__":
    main()
