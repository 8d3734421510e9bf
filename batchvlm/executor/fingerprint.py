"""What a run's outputs depend on: its fingerprint. A run directory holds one (rundir.run) and refuses a job with
another, naming what differs, so that one run never mixes two outputs."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
import transformers

import batchvlm
from batchvlm.executor.config import JobConfig
from batchvlm.families import TINY
from batchvlm.pipeline.chat import text_fingerprint


def weights_digest(module: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def config_digest(checkpoint: Path) -> str:
    file = checkpoint / "config.json"
    return hashlib.sha256(file.read_bytes()).hexdigest() if file.exists() else ""


def run_fingerprint(job: JobConfig, family, encoder) -> dict:
    """The fingerprint of a job whose `auto` choices are resolved (executor.job.resolve_auto)."""
    return {
        **family.fingerprint(),
        "checkpoint": "tiny" if job.model.path == TINY else "local",  # the demo's tiny one is never a real model
        "model_config_sha256": config_digest(family.checkpoint),
        "weights_sha256": weights_digest(encoder),
        "hidden_size": encoder.hidden_size,
        "model_dtype": job.model.dtype,
        "embed_dtype": job.output.embed_dtype,
        "preprocess_backend": job.preprocess.backend,
        "jpeg_decode": job.decode.jpeg,  # resolved: nvJPEG's pixels are not libjpeg-turbo's
        "background": job.preprocess.background,
        "placeholder": job.dataset.placeholder,
        **text_fingerprint(job.dataset.format, job.text, family),
        "versions": {"batchvlm": batchvlm.__version__, "transformers": transformers.__version__,
                     "torch": torch.__version__},
    }
