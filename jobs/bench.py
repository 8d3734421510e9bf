"""`python jobs/bench.py task=preprocess|scale|loader|e2e|host|tower|jpeg|claims|video|clips|train`: measurements side by
side in one run (batchvlm/bench/): triton vs torch vs the family's HF processor; start-up and memory as the dataset
grows; the training loader vs a bare pyarrow scan of the same shards, and packing efficiency; the job vs its tower; the
tower's achieved TFLOP/s; the batched JPEG decode vs the safe path; the metadata operations of claiming per unit as the
ranks grow; PyAV's video decode; clips through the job vs their decode and the tower; training steps on stored features vs on pixels. `dry_run=true` checks the config and
imports the task, and runs nothing."""

from __future__ import annotations

import os

import transformers
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from batchvlm.bench.tasks import BenchConfig, bench_loader, bench_preprocess, format_loader, format_preprocess
from batchvlm.bench.clips import bench_clips, format_clips
from batchvlm.bench.decoding import bench_jpeg, format_jpeg
from batchvlm.bench.e2e import bench_e2e, bench_host, format_e2e, format_host
from batchvlm.bench.metadata import bench_claims, format_claims
from batchvlm.bench.scale import bench_scale, format_scale
from batchvlm.bench.tower import bench_tower, format_tower
from batchvlm.bench.training import bench_train, format_train
from batchvlm.bench.video import bench_video, format_video
from batchvlm.config import exit_on_config_error, job_main

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ConfigStore.instance().store(name="bench_schema", node=BenchConfig)


@job_main("bench")
def main(cfg: DictConfig) -> None:
    transformers.utils.logging.disable_progress_bar()
    tasks = {"preprocess": (bench_preprocess, format_preprocess), "loader": (bench_loader, format_loader),
             "scale": (bench_scale, format_scale), "e2e": (bench_e2e, format_e2e), "host": (bench_host, format_host),
             "tower": (bench_tower, format_tower),
             "jpeg": (bench_jpeg, format_jpeg), "claims": (bench_claims, format_claims),
             "video": (bench_video, format_video), "clips": (bench_clips, format_clips),
             "train": (bench_train, format_train)}
    with exit_on_config_error():
        config = OmegaConf.to_object(cfg)
        run, report = tasks[config.task]
        if config.dry_run:
            print(f"dry run: task={config.task} ({run.__module__}.{run.__name__}), model={config.model.family}, "
                  f"on device={config.device}, records={config.records}, tower={config.tower}, dtype={config.dtype}: "
                  "not run")
            return
        result = run(config)
    print(report(result))


if __name__ == "__main__":
    main()
