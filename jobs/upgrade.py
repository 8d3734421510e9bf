"""`python jobs/upgrade.py run_dir=outputs/<run>`: bring a run directory written in an older output format to the one
this batchvlm reads (rundir/upgrade.py), in place; exit 2 naming what stops it."""

from __future__ import annotations

from omegaconf import DictConfig

from batchvlm.config import exit_on_config_error, job_main, required_path
from batchvlm.format.schema import FORMAT_VERSION, FormatError
from batchvlm.rundir.manifest import DamagedFile, ManifestError
from batchvlm.rundir.upgrade import upgrade_run


@job_main("upgrade")
def main(cfg: DictConfig) -> None:
    with exit_on_config_error(DamagedFile, ManifestError, FormatError):
        run_dir = required_path(cfg, "run_dir", "run_dir=outputs/<run>")
        done = upgrade_run(run_dir)
    if done.found == FORMAT_VERSION:
        print(f"OK {run_dir}: already in output format {FORMAT_VERSION}")
    else:
        print(f"OK {run_dir}: output format {done.found} -> {FORMAT_VERSION}; {done.shards} shards rewritten, "
              f"{done.manifests} manifests")


if __name__ == "__main__":
    main()
