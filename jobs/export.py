"""`python jobs/export.py run_dir=outputs/<run> format=llamafactory|swift out=<new folder>` [name=...]
[shuffle_seed=...]: the run's conversations in LLaMA-Factory's ShareGPT format (with dataset_info.json) or ms-swift's
messages/images format, each image a reference to its stored rows (batchvlm/training/export.py). Exit 0; 2 on a bad
argument, naming the key."""

from __future__ import annotations

from omegaconf import DictConfig, ListConfig

from batchvlm.config import exit_on_config_error, job_main, required_path
from batchvlm.training.export import SKIPS, export_run


@job_main("export")
def main(cfg: DictConfig) -> None:
    with exit_on_config_error():
        # a run, or a run and its requeue runs as one dataset: run_dir=[outputs/<run>,outputs/<run>-requeue]
        run_dir = [str(run) for run in cfg.run_dir] if isinstance(cfg.get("run_dir"), ListConfig) else \
            required_path(cfg, "run_dir", "run_dir=outputs/<run>")
        format = str(required_path(cfg, "format", "format=llamafactory|swift"))
        out = required_path(cfg, "out", "out=<a new folder>")
        summary = export_run(run_dir, format, out, cfg.name, cfg.shuffle_seed)
    skipped = ", ".join(f"{count} {reason}" for reason, count in sorted(summary.skipped.items())) or "none"
    print(f"exported {summary.exported} conversations of {run_dir} to {summary.out} ({format}); skipped: {skipped}")
    for reason in sorted(summary.skipped):
        print(f"  {reason}: {SKIPS[reason]}")
    print("files: " + ", ".join(str(path) for path in summary.files))


if __name__ == "__main__":
    main()
