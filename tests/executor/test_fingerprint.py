"""A run's fingerprint by declaration: every config field states what it does to the output, and the fingerprint
changes with every field that changes what is written or quarantined, and with no other."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from conftest import REPO

from batchvlm.config import Effect, declared, effect_of, fingerprinted
from batchvlm.executor.config import JobConfig
from batchvlm.executor.fingerprint import run_fingerprint
from batchvlm.families import TINY, ModelConfig, load_family
from batchvlm.families.qwen2_vl import VIDEO_RULE
from batchvlm.pipeline.chat import TextConfig
from batchvlm.sizing.estimate import EstimateConfig
from batchvlm.sources.config import SCHEMAS, DiskDataset, JsonDataset

OTHER = {
    "run_name": "other", "requeue_from": "/runs/b", "check": ["decode.truncated"],
    "dataset.format": "messages", "dataset.image_first": True, "dataset.storage_options": {"anon": True},
    "dataset.id_column": "key", "dataset.images_column": "jpg", "dataset.text_column": "caption",
    "dataset.status_column": "status", "dataset.require_images": True, "dataset.image_root": "/images",
    "dataset.fetch_urls": True, "dataset.placeholder": "<img>", "dataset.missing_placeholder": "quarantine",
    "dataset.unit_records": 5, "dataset.limit": 10, "dataset.unit_bytes": 1000, "dataset.path": "/elsewhere.json",
    "dataset.split": "validation", "dataset.missing_ids": "content", "dataset.videos_column": "clips",
    "model.family": "qwen2_vl", "model.path": "/checkpoints/b", "model.tokenizer_path": "/tokenizer",
    "model.dtype": "bfloat16", "model.device": "cpu", "model.attn_implementation": "eager", "model.embedding": "tower",
    "model.framing": "plain", "model.trust_remote_code": True, "model.chat_template": None,
    "model.processor": {"max_pixels": 1000},
    "decode.formats": ["JPEG"], "decode.max_pixels": 1000, "decode.max_bytes": 1000, "decode.isolation": "none",
    "decode.timeout_s": 5.0, "decode.jpeg": "device",
    "video.max_bytes": 1000, "video.max_duration_s": 10.0, "video.max_frames": 100, "video.max_frame_pixels": 1000,
    "video.max_decoded_bytes": 1000, "video.max_fps": 60.0, "video.timeout_s": 5.0,
    "preprocess.backend": "reference", "preprocess.token_budget": 1024, "preprocess.max_images_per_batch": 8,
    "preprocess.background": "white", "preprocess.fallback": "quarantine", "preprocess.parity_sample_rate": 0.5,
    "preprocess.parity_max_levels": 1.0,
    "output.root": "/elsewhere", "output.embed_dtype": "float16", "output.compression": "snappy",
    "output.quarantine_bytes_cap": 0, "output.shard_bytes": 1000,
    "checks.max_quarantine_fraction": 0.9, "checks.min_records": 5,
    "runtime.num_workers": 0, "runtime.prefetch": 2, "runtime.writer_queue": 2, "runtime.progress": False,
    "runtime.progress_interval_s": 5.0, "runtime.lease_s": 60.0, "runtime.poll_s": 1.0, "runtime.overlap": False,
    "runtime.dedup_buckets": 4, "runtime.block_units": 2,
    "text.train_on": "last_assistant", "text.max_tokens": 2048, "text.overflow": "drop_turns",
    "text.control_tokens": "text",
}
"""Another valid value of every key of a run's config (the kind of input is the schema's: see below)."""


def base_job(key: str, chat_template) -> JobConfig:
    """A conversation dataset (so that every text setting applies) in JSON (a saved dataset for dataset.split), with a
    chat template, a length limit and a requeue, so that every key of OTHER is a valid change."""
    kind = DiskDataset if key == "dataset.split" else JsonDataset
    return JobConfig(dataset=kind(path="/data.json", format="llava"),
                     text=TextConfig(max_tokens=4096), requeue_from="/runs/a",
                     model=ModelConfig(path="/checkpoints/a", chat_template=str(chat_template)))


def changed(job: JobConfig, key: str, value) -> JobConfig:
    """The job with one key set to another value, every schema's checks run again."""
    section, _, name = key.rpartition(".")
    if not section:
        return dataclasses.replace(job, **{name: value})
    return dataclasses.replace(job, **{section: dataclasses.replace(getattr(job, section), **{name: value})})


@pytest.fixture(scope="module")
def parts(kimi_family, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(kimi_family.tokenizer.chat_template)
    return kimi_family, kimi_family.load_encoder(torch.device("cpu"), torch.float32), template


def test_every_config_field_declares_what_it_does_to_the_output():
    for schema in {nested for top in (JobConfig, EstimateConfig, *SCHEMAS.values()) for nested in _schemas_in(top)}:
        for field in dataclasses.fields(schema):
            if not _is_schema(field):
                assert isinstance(effect_of(field, schema), Effect), f"{schema.__name__}.{field.name}"


def test_an_undeclared_field_cannot_be_fingerprinted():
    @dataclasses.dataclass
    class Forgotten:
        new_key: int = 3

    with pytest.raises(TypeError, match="Forgotten.new_key declares no Effect"):
        fingerprinted(Forgotten())


def test_settings_that_mixed_two_outputs_in_one_run_are_in_the_fingerprint(parts):
    """What a relaunch could change without a word before (issue 29): each is refused now."""
    family, encoder, template = parts
    for key in ("preprocess.fallback", "preprocess.parity_sample_rate", "preprocess.parity_max_levels",
                "dataset.image_first", "dataset.missing_placeholder", "dataset.require_images", "decode.max_pixels",
                "decode.max_bytes", "decode.formats"):
        job = base_job(key, template)
        assert run_fingerprint(changed(job, key, OTHER[key]), family, encoder) != run_fingerprint(
            job, family, encoder), key


def test_a_named_file_counts_by_its_content(parts, tmp_path):
    """model.chat_template names a file: the same template elsewhere is the same run, another template is not."""
    _, encoder, template = parts
    same, other = tmp_path / "same.jinja", tmp_path / "other.jinja"
    same.write_text(template.read_text())
    other.write_text("{# another template #}" + template.read_text())
    fingerprints = {}
    for path in (template, same, other):
        job = changed(base_job("", path), "model.path", TINY)
        fingerprints[path] = run_fingerprint(job, load_family(job.model), encoder)
    assert fingerprints[same] == fingerprints[template] != fingerprints[other]


def every_key() -> dict[str, Effect]:
    """Every key of a run's config, over every kind of dataset."""
    return {key: effect for kind in SCHEMAS.values()
            for key, effect in declared(JobConfig(dataset=_example(kind))).items()}


def test_the_configuration_page_says_which_keys_the_fingerprint_leaves_out():
    page = (REPO / "docs" / "configuration.md").read_text()
    for effect, lead in ((Effect.OPERATIONAL, "How the job runs, never in the fingerprint:"),
                         (Effect.READ_FROM, "What is read, in the fingerprint or the plan by its content:")):
        paragraph = next(paragraph for paragraph in page.split("\n\n") if paragraph.startswith(lead))
        assert set(re.findall(r"`([\w.]+)`", paragraph)) == {key for key, e in every_key().items() if e is effect}


def _example(kind: type):
    return kind(path="/data.json") if "path" in {f.name for f in dataclasses.fields(kind)} else kind()


def _is_schema(field: dataclasses.Field) -> bool:
    factory = field.default_factory
    return isinstance(factory, type) and dataclasses.is_dataclass(factory)


def _schemas_in(schema: type) -> list[type]:
    nested = [field.default_factory for field in dataclasses.fields(schema) if _is_schema(field)]
    return [schema] + [inner for child in nested for inner in _schemas_in(child)]


def test_clips_count_in_the_fingerprint_only_where_the_format_can_name_them(parts):
    """The video keys and the family's clip rule: in a llava or messages run's fingerprint, and a plain text's that
    names a clip column (dataset.videos_column); out of every other, whose fingerprint is what it was before clips
    were read (a resume of such a run is not refused): dataset.videos_column is in it only where set."""
    _, _, template = parts
    qwen = load_family(ModelConfig(family="qwen2_vl"))
    encoder = qwen.load_encoder(torch.device("cpu"), torch.float32)
    conversation = changed(base_job("", template), "model.path", TINY)
    plain = changed(changed(conversation, "dataset.format", "text"), "text.train_on", "all")
    captioned_clips = changed(plain, "dataset.videos_column", "mp4")
    assert "videos_column" not in run_fingerprint(plain, qwen, encoder)["settings"]["dataset"]
    for job, takes_clips in ((conversation, True), (plain, False), (captioned_clips, True)):
        fingerprint = run_fingerprint(job, qwen, encoder)
        other = run_fingerprint(changed(job, "video.max_frames", 100), qwen, encoder)
        assert (other != fingerprint) is takes_clips
        assert ("video" in fingerprint["settings"], "video_rule" in fingerprint) == (takes_clips, takes_clips)
    rule = run_fingerprint(conversation, qwen, encoder)["video_rule"]
    assert rule["rule"] == VIDEO_RULE and rule["params"] == dataclasses.asdict(qwen.video_params)
