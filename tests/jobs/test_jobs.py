"""The jobs as a user meets them: installed console scripts that find their packaged configs, Hydra's
multirun resuming like a single run, and error paths that name the key instead of a traceback."""

from __future__ import annotations

from importlib.metadata import distribution

from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from batchvlm.executor.config import register_schemas

SCRIPTS = {"batchvlm-embed": "batchvlm.jobs.embed:main", "batchvlm-report": "batchvlm.jobs.report:main",
           "batchvlm-verify": "batchvlm.jobs.verify:main", "batchvlm-bench": "batchvlm.jobs.bench:main",
           "batchvlm-estimate": "batchvlm.jobs.estimate:main", "batchvlm-status": "batchvlm.jobs.status:main",
           "batchvlm-upgrade": "batchvlm.jobs.upgrade:main", "batchvlm-push": "batchvlm.jobs.push:main",
           "batchvlm-export": "batchvlm.jobs.export:main"}


def test_console_scripts_point_at_the_jobs():
    scripts = {ep.name: ep for ep in distribution("batchvlm").entry_points if ep.group == "console_scripts"}
    assert {name: ep.value for name, ep in scripts.items()} == SCRIPTS
    assert all(callable(ep.load()) for ep in scripts.values())


def test_the_packaged_configs_compose_as_pkg_batchvlm_conf():
    register_schemas()
    with initialize_config_module("batchvlm.conf", version_base=None):
        cfg = compose(config_name="embed", overrides=["model=qwen2_vl_tiny"], return_hydra_config=True)
    assert (cfg.dataset.kind, cfg.model.family) == ("demo", "qwen2_vl")
    # a sweep's jobs land where their single runs would, so a rerun of the sweep resumes them
    sweep, run = OmegaConf.to_container(cfg.hydra.sweep), OmegaConf.to_container(cfg.hydra.run)
    assert f"{sweep['dir']}/{sweep['subdir']}" == run["dir"] == "${output.root}/${run_name}"
