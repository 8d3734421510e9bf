"""`python jobs/push.py run_dir=outputs/<run> repo_id=<user or org>/<name> license=<id>`: publish a finished run to a
Hugging Face Hub dataset repo (batchvlm/publish/hub.py): its manifest-listed data shards and a dataset card written
from the run, resumably; a second push of an unchanged run commits nothing. The token and endpoint are
huggingface_hub's own (`HF_TOKEN` or `hf auth login`, `HF_ENDPOINT`). Exit 0; 2 naming the key, the shard or the
holder of the run's push lock that stops it."""

from __future__ import annotations

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig

from batchvlm.config import exit_on_config_error, job_main, to_job_config
from batchvlm.publish.hub import PushConfig, PushRefused, format_push, push_run

ConfigStore.instance().store(name="push_schema", node=PushConfig)


@job_main("push")
def main(cfg: DictConfig) -> None:
    with exit_on_config_error(PushRefused):
        result = push_run(to_job_config(cfg, PushConfig))
    print(format_push(result))


if __name__ == "__main__":
    main()
