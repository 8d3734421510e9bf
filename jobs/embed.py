"""The main job: `python jobs/embed.py [overrides]` (see docs/configuration.md)."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
from pathlib import Path

import transformers
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from batchvlm.config import ConfigError, fail, job_main, to_job_config
from batchvlm.executor.config import JobConfig, register_schemas
from batchvlm.executor.job import JobAborted, QuarantineOverLimit, Terminated, run_job, summarize

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
register_schemas()


@job_main("embed")
def main(cfg: DictConfig) -> None:
    transformers.utils.logging.disable_progress_bar()
    signal.signal(signal.SIGTERM, _terminate)  # a clean exit takes the DataLoader workers and the decoder with it
    hydra_config = HydraConfig.get()
    run_dir = Path(hydra_config.runtime.output_dir)
    try:
        job = to_job_config(cfg, JobConfig)
        summary = run_job(job, run_dir)
    except (ConfigError, JobAborted) as error:
        _remove_if_empty(run_dir, Path(hydra_config.job_logging.handlers.file.filename))
        if isinstance(error, QuarantineOverLimit):  # the run finished: its summary, then why it failed
            print(summarize(error.summary))
        fail(str(error), 2)
    except Terminated:
        fail("stopped by SIGTERM; the committed units are kept: rerun the same command to resume", 143)
    except (OSError, RuntimeError) as error:
        if (full := _disk_full(error)) is None:
            raise
        fail(f"no space left on the device writing {full.filename}; the committed units are kept: free space and "
              "rerun the same command to resume", 1)
    if summary is not None:  # rank 0 speaks for the job
        print(summarize(summary))


def _terminate(signum, frame) -> None:
    raise Terminated(signal.Signals(signum).name)


def _disk_full(error: BaseException) -> OSError | None:
    """The ENOSPC at the root of an error (the writer thread's arrives wrapped)."""
    while error is not None:
        if isinstance(error, OSError) and error.errno == errno.ENOSPC:
            return error
        error = error.__cause__
    return None


def _remove_if_empty(run_dir: Path, log: Path) -> None:
    """Hydra makes the run directory before the config can be checked: a refused config leaves none behind (and
    no log of its own, which holds only what led to the refusal, said on stderr)."""
    with contextlib.suppress(OSError):  # not empty: the job ran (or an earlier run did), its files stay
        if log.parent == run_dir and {p.name for p in run_dir.iterdir()} == {log.name}:
            log.unlink()
        run_dir.rmdir()


if __name__ == "__main__":
    main()
