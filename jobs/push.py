"""`python jobs/push.py run_dir=outputs/<run> repo_id=<user or org>/<name> license=<id>`: publish a finished run to a
Hugging Face Hub dataset repo (batchvlm/publish/hub.py): its manifest-listed data shards and a dataset card written
from the run, resumably; a second push of an unchanged run commits nothing. The token and endpoint are
huggingface_hub's own (`HF_TOKEN` or `hf auth login`, `HF_ENDPOINT`). Exit 0; 2 naming the key, the shard or the
holder of the run's push lock that stops it; 1 where the Hub or the network stopped it (pushing again resumes)."""

from __future__ import annotations

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig

from huggingface_hub.errors import HfHubHTTPError

from batchvlm.config import exit_on_config_error, fail, job_main, to_job_config
from batchvlm.publish.hub import PushConfig, PushRefused, format_push, push_run
from batchvlm.rundir.manifest import ManifestError

ConfigStore.instance().store(name="push_schema", node=PushConfig)


@job_main("push")
def main(cfg: DictConfig) -> None:
    with exit_on_config_error(PushRefused, ManifestError):
        config = to_job_config(cfg, PushConfig)
        try:
            result = push_run(config)
        except (HfHubHTTPError, OSError) as error:  # the Hub's refusal (a token, a permission), the network
            fail(f"the push to {config.repo_id} stopped: {error}; what was committed stays, push again to resume", 1)
    print(format_push(result))


if __name__ == "__main__":
    main()
