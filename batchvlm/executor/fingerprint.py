"""What a run's outputs depend on: its fingerprint. A run directory holds one (rundir.run) and refuses a job with
another, naming what differs, so that one run never mixes two outputs.

The settings' part is computed from their declarations: every config field states whether it changes what is written
or quarantined (batchvlm.config: written, read_from, operational), and the values of the `written` ones are in the
fingerprint, so a key added to a config is in it, or declared out of it, by construction. What a `read_from` setting
names is in it by content: the checkpoint's config and weights, its tokenizer and the chat template, by digest.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
import transformers

import batchvlm
from batchvlm.config import fingerprinted
from batchvlm.executor.config import JobConfig
from batchvlm.families import TINY
from batchvlm.pipeline.chat import template_digest
from batchvlm.pipeline.jpeg import decoder_of
from batchvlm.sources.config import TextFormat
from batchvlm.sources.rows import video_column


def weights_digest(module: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def config_digest(checkpoint: Path) -> str:
    file = checkpoint / "config.json"
    return hashlib.sha256(file.read_bytes()).hexdigest() if file.exists() else ""


def takes_clips(job: JobConfig) -> bool:
    """Whether the job's dataset can name clips (a video column, its own or the format's, and `<video>` /
    `{type: video}` in its text or turns)."""
    return video_column(job.dataset) is not None


def _settings(job: JobConfig) -> dict:
    """The written settings; the `video` group's only where the dataset can name a clip: a run of another format
    reads none, and keeps the fingerprint it had before clips were read (its resume is not refused); likewise
    dataset.videos_column only where set."""
    settings = fingerprinted(job)
    if not takes_clips(job):
        settings.pop("video", None)
    if job.dataset.videos_column is None:
        settings["dataset"].pop("videos_column", None)
    return settings


def _video(job: JobConfig, family) -> dict:
    """The family's clip rule (sampling, sizes, prompt, positions, read from the checkpoint), where the format can
    name clips; a family without one quarantines them (text.video), and says so here."""
    if not takes_clips(job):
        return {}
    rule = getattr(family, "video_fingerprint", None)
    return {"video_rule": rule() if rule is not None else None}


def run_fingerprint(job: JobConfig, family, encoder) -> dict:
    """The fingerprint of a job whose `auto` choices are resolved (executor.job.resolve_auto: the backends' pixels
    differ by a level, nvJPEG's are not libjpeg-turbo's)."""
    conversations = job.dataset.format != TextFormat.text
    return {
        "settings": _settings(job),
        **family.fingerprint(),  # the processor's parameters as the checkpoint and model.processor resolve them
        **_video(job, family),
        "checkpoint": "tiny" if job.model.path == TINY else "local",  # the demo's tiny one is never a real model
        "model_config_sha256": config_digest(family.checkpoint),
        "weights_sha256": weights_digest(encoder),
        "hidden_size": encoder.hidden_size,
        "jpeg_decoder": decoder_of(job.decode.jpeg, next(encoder.parameters()).device),  # nvJPEG's pixels differ
        "chat_template_sha256": template_digest(family) if conversations else None,
        "versions": {"batchvlm": batchvlm.__version__, "transformers": transformers.__version__,
                     "torch": torch.__version__},
    }
