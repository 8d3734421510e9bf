"""batchvlm-push against a local stand-in for the Hub (fake_hub.py, huggingface_hub's own HfApi answered from a
folder): what the repo ends up holding is read back with `datasets.load_dataset` and compared with `read_run`."""

from __future__ import annotations

import sys

import pytest

from batchvlm.config import ConfigError
from batchvlm.publish.hub import PushConfig
from batchvlm.rundir.layout import RunLayout

REPO_ID = "someone/features"


@pytest.mark.parametrize("setting,message", [
    ({"repo_id": "features"}, "repo_id='features' is not a Hub repo id: <user or org>/<name>"),
    ({"license": "CC BY 4.0"}, "license='CC BY 4.0' is not a Hub license id"),
    ({"files_per_commit": 100}, "files_per_commit=100 is over 99: the Hub recommends under 100 files a commit"),
    ({"files_per_commit": 0}, "files_per_commit=0 must be > 0"),
    ({"visibility": "secret"}, "visibility='secret' is not one of private, public"),
    ({"run_dir": "elsewhere"}, "run_dir='elsewhere' is not a batchvlm run directory"),
])
def test_a_bad_push_config_is_refused_naming_the_key(tmp_path, setting, message):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    RunLayout(run_dir).marker.touch()
    settings = {"run_dir": str(run_dir), "repo_id": REPO_ID, "license": "cc-by-4.0", **setting}
    with pytest.raises(ConfigError, match=message):
        PushConfig(**settings)
    assert [path.name for path in run_dir.iterdir()] == [".batchvlm"]


@pytest.mark.parametrize("arguments,message", [
    ([], "error: run_dir is required: give run_dir=..."),
    (["run_dir={run}"], "error: repo_id is required: give repo_id=..."),
    (["run_dir={run}/nowhere", f"repo_id={REPO_ID}", "license=mit"], "error: run_dir='{run}/nowhere' is not a "
                                                                      "batchvlm run directory (no .batchvlm marker)"),
    (["run_dir={run}", f"repo_id={REPO_ID}", "license=mit", "visibility=secret"],
     "error: visibility: Invalid value 'secret', expected one of [private, public]"),
])
def test_the_push_job_refuses_a_bad_config_with_exit_2_naming_the_key_before_any_work(tmp_path, monkeypatch, capsys,
                                                                                      arguments, message):
    from batchvlm.jobs.push import main

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    RunLayout(run_dir).marker.touch()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["batchvlm-push", *[argument.format(run=run_dir) for argument in arguments]])
    with pytest.raises(SystemExit) as exited:
        main()
    assert (exited.value.code, capsys.readouterr().err.strip()) == (2, message.format(run=run_dir))
    assert sorted(path.name for path in tmp_path.iterdir()) == ["run"]
    assert [path.name for path in run_dir.iterdir()] == [".batchvlm"]
