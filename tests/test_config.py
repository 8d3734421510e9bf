"""Every shipped config composes and validates; wrong keys and values fail naming the key."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import MissingConfigException
from omegaconf import OmegaConf

from batchvlm.config import ConfigError, check_command_line, check_overrides_compose, to_job_config
from batchvlm.executor.config import JobConfig, register_schemas
from batchvlm.pipeline.decode import DecodeConfig, JpegDecode
from batchvlm.sources.config import SourceKind

CONF = Path(__file__).resolve().parents[1] / "conf"
STAND_INS = {"dataset.path": "/data/x.parquet", "model.path": "/ckpt"}
"""A value for each key a shipped config leaves for the command line (`???`)."""


def job(*overrides):
    register_schemas()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(config_name="embed", overrides=list(overrides))
        cfg.run_name = "test"  # the default interpolates Hydra's runtime choices, absent in compose
        return to_job_config(cfg, JobConfig)


@pytest.mark.parametrize("group,option", sorted((p.parent.name, p.stem) for p in CONF.glob("*/*.yaml")))
def test_every_shipped_config_loads(group, option):
    register_schemas()  # its resolvers: a YAML may name a path one builds (the demo's clips)
    shipped = OmegaConf.to_container(OmegaConf.load(CONF / group / f"{option}.yaml"), resolve=True)
    schemas = shipped.pop("defaults", [])
    given = {key: STAND_INS[f"{group}.{key}"] for key, value in shipped.items() if value == "???"}
    section = dataclasses.asdict(getattr(job(f"{group}={option}", *(f"{group}.{k}={v}" for k, v in given.items())),
                                         group))
    assert {key: section[key] for key in shipped} == {**shipped, **given}
    if group == "dataset":  # a dataset YAML names its kind's schema, which sets the kind
        assert schemas == [f"/dataset_schema/{section['kind']}@_here_", "_self_"]


def test_each_group_offers_its_yaml_files_and_no_schema():
    """What --help and tab completion list, and what `group=option` accepts: the YAML files, and the dataset kinds'
    schemas in a group of their own, which only a dataset YAML names."""
    register_schemas()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        loader = GlobalHydra.instance().config_loader()
        options = {group: loader.get_group_options(group) for group in loader.list_groups("") if group != "hydra"}
        with pytest.raises(MissingConfigException, match="model/schema"):
            compose(config_name="embed", overrides=["model=schema"])
        with pytest.raises(Exception, match="dataset_schema"):
            compose(config_name="embed", overrides=["dataset_schema=parquet"])
    assert options == {**{group: sorted(p.stem for p in (CONF / group).glob("*.yaml"))
                          for group in ("checks", "dataset", "model", "output", "preprocess")},
                       "dataset_schema": sorted(kind.value for kind in SourceKind)}


def test_a_dataset_kind_takes_only_its_own_keys():
    """One schema per kind of input: a key another kind reads fails at load, naming it; a YAML of your own extends a
    shipped one."""
    with pytest.raises(Exception, match=r"dataset\.split"):
        job("dataset=parquet", "dataset.path=/x.parquet", "dataset.split=validation")
    with pytest.raises(Exception, match=r"dataset\.unit_bytes"):
        job("dataset=webdataset", "dataset.path=/x.tar", "dataset.unit_bytes=5")
    assert job("dataset=hub", "dataset.path=org/name", "dataset.split=validation").dataset.split == "validation"
    with pytest.raises(ConfigError, match="dataset.kind=json: this dataset's schema reads parquet"):
        job("dataset=parquet", "dataset.path=/x.parquet", "dataset.kind=json")


def test_a_bad_choice_fails_naming_the_key_and_the_choices():
    """Choices are Enums: OmegaConf refuses another value as the config composes, naming the key and every choice;
    in Python the schema does the same."""
    with pytest.raises(Exception) as caught:
        job("model.dtype=int8")
    message = f"{caught.value} {caught.value.__cause__}"
    assert "model.dtype=int8" in message and "float32, bfloat16, float16" in message
    with pytest.raises(ConfigError, match=r"decode\.jpeg='nvjpeg' is not one of safe, device, auto"):
        DecodeConfig(jpeg="nvjpeg")
    assert DecodeConfig(jpeg="device").jpeg is JpegDecode.device and f"{JpegDecode.device}" == "device"


def test_unknown_key_fails_naming_it():
    with pytest.raises(ConfigError, match=r"model\.pth is not a config key"):
        job("+model.pth=/x")
    with pytest.raises(Exception, match="pth"):
        job("model.pth=/x")


def test_wrong_type_fails_naming_the_key():
    with pytest.raises(Exception, match="unit_records"):
        job("dataset.unit_records=many")


@pytest.mark.parametrize("override,key", [
    ("model.dtype=int8", "model.dtype"), ("preprocess.token_budget=0", "preprocess.token_budget"),
    ("checks.max_quarantine_fraction=2", "checks.max_quarantine_fraction"),
    ("dataset=parquet", "dataset.path"),
    ("dataset.format=sharegpt", "dataset.format"), ("text.train_on=assistant", "text.train_on"),
    ("text.overflow=drop_turns", "text.overflow"), ("text.max_tokens=0", "text.max_tokens"),
    ("model.chat_template=/no/such.jinja", "model.chat_template"), ("dataset.image_first=true", "dataset.image_first"),
])
def test_bad_values_fail_naming_the_key(override, key):
    with pytest.raises(Exception, match=key.replace(".", r"\.")):
        job(override)


def test_flash_attention_in_fp32_is_refused_before_any_work_naming_both_keys():
    """flash_attention_2 raises 'only fp16/bf16' on every batch in fp32: refused at load, as any setting that cannot
    work (the tiny configs leave model.dtype at float32)."""
    with pytest.raises(ConfigError, match=r"model\.attn_implementation=flash_attention_2 .* model\.dtype=float32"):
        job("model.attn_implementation=flash_attention_2")
    assert job("model.attn_implementation=flash_attention_2", "model.dtype=bfloat16").model.dtype == "bfloat16"


def test_unknown_processor_parameter_is_refused():
    from batchvlm.families import ModelConfig
    from batchvlm.families import load_family

    with pytest.raises(ConfigError, match="model.processor.max_pixels"):
        load_family(ModelConfig(processor={"max_pixels": 5}))


@pytest.mark.parametrize("family,overrides,key", [
    ("siglip2", {"embedding": "projector"}, "model.embedding"),
    ("qwen2_vl", {"processor": {"min_pixels": 10**9}}, "min_pixels"),
    ("qwen2_vl", {"processor": {"max_num_patches": 5}}, "model.processor.max_num_patches"),
    ("qwen2_vl", {"processor": {"min_pixels": 100}}, "model.processor.min_pixels"),
])
def test_a_family_refuses_settings_it_cannot_honour(family, overrides, key):
    from batchvlm.families import ModelConfig
    from batchvlm.families import load_family

    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_family(ModelConfig(family=family, **overrides))


def test_an_unknown_family_is_refused_naming_the_key():
    from batchvlm.families import ModelConfig
    from batchvlm.families import load_family

    with pytest.raises(ConfigError, match="model.family='clip'"):
        load_family(ModelConfig(family="clip"))


def test_processor_parameters_that_contradict_the_tower_are_refused_at_load():
    import torch

    from batchvlm.families import ModelConfig
    from batchvlm.families import load_family

    family = load_family(ModelConfig(family="qwen2_vl", processor={"patch_size": 16}))
    with pytest.raises(ConfigError, match=r"model\.processor\.patch_size=16 but the checkpoint's tower has patch_size=14"):
        family.load_encoder(torch.device("cpu"), torch.float32)


def test_a_conversation_format_on_a_checkpoint_without_a_chat_template_fails_before_any_work(tmp_path):
    """SigLIP2 has no LLM and so no template: the job refuses it at start, leaving no run directory."""
    from batchvlm.executor.job import run_job

    cfg = job("dataset=llava", f"dataset.path={tmp_path / 'x.json'}", "model=siglip2_tiny")
    with pytest.raises(ConfigError, match="model.chat_template"):
        run_job(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_a_brace_pattern_the_shell_expanded_is_refused_naming_the_key_and_how_to_quote_it():
    expanded = ["dataset=webdataset", "dataset.path=shards/00000.tar", "dataset.path=shards/00001.tar",
                "dataset.path=shards/00002.tar"]
    with pytest.raises(ConfigError, match=r"dataset.path is given 3 times \(shards/00000.tar, .*quote the pattern: "
                                          r"\"dataset.path='shards/\{00000..00009\}.tar'\""):
        check_command_line(expanded)
    with pytest.raises(ConfigError, match=r"dataset.path=s3://b/\{a,b\}/x.tar: a brace pattern must reach Hydra "
                                          r"quoted .*\"dataset.path='s3://b/\{a,b\}/x.tar'\""):
        check_command_line(["dataset.path=s3://b/{a,b}/x.tar"])
    check_command_line(["dataset.path='shards/{00000..00009}.tar'", "dataset.storage_options={anon: true}", "-m",
                        "model=qwen2_vl_tiny"])
    check_command_line(["+dataset.path=['a/{0..3}.tar', 'b.tar']"])


def test_the_jobs_check_their_command_line_before_hydra_reads_it(monkeypatch, capsys):
    from batchvlm.jobs import embed

    monkeypatch.setattr(sys, "argv", ["embed.py", "dataset.path=a/0.tar", "dataset.path=a/1.tar"])
    with pytest.raises(SystemExit) as exited:
        embed.main()
    assert exited.value.code == 2 and "error: dataset.path is given 2 times" in capsys.readouterr().err


@pytest.mark.parametrize("override,message", [
    ("model.pth=/nowhere", "model.pth: Key 'pth' not in 'ModelConfig'"),
    ("output.embed_dtype=int3", "output.embed_dtype: Invalid value 'int3', expected one of"),
    ("checks.min_records=many", "checks.min_records: Value 'many' of type 'str' could not be converted to Integer"),
    ("model=qwen9", "Could not find 'model/qwen9'")])
def test_an_override_the_schema_refuses_is_a_config_error_naming_the_key_before_hydra_runs(override, message):
    """The job's entry point composes the command line first (job_main): exit 2 and this one line, no run folder."""
    register_schemas()
    with pytest.raises(ConfigError) as refused:
        check_overrides_compose("embed", [override])
    assert message in str(refused.value) and "\n" not in str(refused.value).split("Available options")[0].strip()


def test_an_output_root_under_a_file_is_refused_naming_the_key_before_hydra_makes_the_run_folder(tmp_path):
    """Hydra makes `${output.root}/${run_name}` before the job runs: under a file, that was its NotADirectoryError."""
    register_schemas()
    (tmp_path / "notes.txt").write_text("a user's file")
    for root in (tmp_path / "notes.txt", tmp_path / "notes.txt" / "deeper"):
        with pytest.raises(ConfigError, match=rf"^output.root={root}: {tmp_path / 'notes.txt'} is a file, not a "
                                              "folder"):
            check_overrides_compose("embed", [f"output.root={root}"])
    assert [path.name for path in tmp_path.iterdir()] == ["notes.txt"]
    check_overrides_compose("embed", [f"output.root={tmp_path / 'new folder'}"])  # one to make is fine


def test_a_sweep_is_left_to_hydra_to_compose_job_by_job():
    register_schemas()
    check_overrides_compose("embed", ["-m", "run_name=a,b"])


def test_an_empty_path_on_the_command_line_is_refused_naming_its_key_not_read_as_the_current_folder():
    """`run_dir=` or `out=` give an empty string, which Path() reads as "." (the user's current folder)."""
    from omegaconf import OmegaConf

    from batchvlm.config import ConfigError, required_path

    for blank in ("", "  "):
        with pytest.raises(ConfigError, match=r"^run_dir is empty: run_dir=outputs/<run>$"):
            required_path(OmegaConf.create({"run_dir": blank}), "run_dir", "run_dir=outputs/<run>")
    assert str(required_path(OmegaConf.create({"out": "a b/c"}), "out", "out=...")) == "a b/c"
