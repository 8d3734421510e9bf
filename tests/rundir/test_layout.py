"""The run layout names the paths of the output contract (docs/output.md), and a manifest's names round-trip."""

from __future__ import annotations

from pathlib import Path

from batchvlm.rundir.layout import DATA, IDS, QUARANTINE, RunLayout


def test_the_paths_are_those_of_the_output_contract():
    run = RunLayout(Path("/runs/demo"))
    assert [run.config, run.fingerprint, run.plan, run.success] == [
        Path("/runs/demo/config.yaml"), Path("/runs/demo/fingerprint.json"), Path("/runs/demo/units.json"),
        Path("/runs/demo/_SUCCESS")]
    assert run.manifest("a-00000000-00000010") == Path("/runs/demo/manifest/a-00000000-00000010.json")
    assert run.shard(DATA, "a-00000000-00000010", "x3f0") == Path("/runs/demo/data/a-00000000-00000010.x3f0.parquet")
    assert run.report_page == Path("/runs/demo/report/index.html")


def test_each_claim_writes_shards_of_its_own():
    run = RunLayout(Path("/runs/demo"))
    first, second = (run.shard(QUARANTINE, "u", token) for token in ("a0", "b1"))
    assert first != second and first.parent == second.parent == run.folder(QUARANTINE)


def test_a_manifest_names_files_relative_to_the_run_and_they_resolve_back(tmp_path):
    run = RunLayout(tmp_path / "moved-later")
    shard = run.shard(IDS, "u", "a0")
    assert run.name_of(shard) == "ids/u.a0.parquet"
    assert RunLayout(tmp_path / "elsewhere").listed(run.name_of(shard)) == tmp_path / "elsewhere" / "ids/u.a0.parquet"


def test_a_unit_commits_into_its_shard_folders_and_the_manifest_folder():
    run = RunLayout(Path("/r"))
    assert run.unit_folders() == [Path("/r/data"), Path("/r/quarantine"), Path("/r/ids"), Path("/r/manifest")]
    assert run.unit_of(run.manifest("u-1")) == "u-1"


def test_a_units_further_files_carry_its_claim_and_a_number():
    run = RunLayout(Path("/r"))
    parts = [run.shard(DATA, "a.b-00000000-00000010", "x3f0", part) for part in range(3)]
    assert [path.name for path in parts] == ["a.b-00000000-00000010.x3f0.parquet",
                                             "a.b-00000000-00000010.x3f0-1.parquet",
                                             "a.b-00000000-00000010.x3f0-2.parquet"]
    assert {run.claim_of(path) for path in parts} == {("a.b-00000000-00000010", "x3f0")}
