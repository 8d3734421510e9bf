"""The run directory: resolved config, fingerprint, schema metadata, and the run's totals written last.

A run directory belongs to one fingerprint (family, processor, checkpoint digests, dtypes,
versions). Reopening it with another is refused, naming what differs, so runs never mix.
"""

from __future__ import annotations

import hashlib
import json
import platform

from pathlib import Path

import torch
import transformers
from omegaconf import OmegaConf

import batchvlm
from batchvlm.config import TINY, ConfigError, JobConfig, differences
from batchvlm.faults import crash_point
from batchvlm.format.hf_features import SIZE_KEY, features_key
from batchvlm.pipeline.chat import text_fingerprint
from batchvlm.pipeline.jpeg import decoder_of
from batchvlm.pipeline.preprocess import merged_stats
from batchvlm.rundir.dedup import bucket_results
from batchvlm.rundir.durable import durable_write, durable_write_json, read_json
from batchvlm.rundir.layout import RunLayout
from batchvlm.rundir.manifest import RunTotals


def weights_digest(module: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def config_digest(checkpoint: Path) -> str:
    file = checkpoint / "config.json"
    return hashlib.sha256(file.read_bytes()).hexdigest() if file.exists() else ""


def check_ours(layout: RunLayout) -> None:
    """The run directory is new or a batchvlm run's (its marker): the job never writes, nor cleans up, in a folder
    of someone else's files."""
    if not layout.root.exists() or layout.marker.exists():
        return
    if layout.fingerprint.exists() and layout.plan.exists():
        return  # a run written before the marker: reopening it writes one
    if found := sorted(path.name for path in layout.root.iterdir()):
        raise ConfigError(f"{layout.root} is not empty and not a batchvlm run directory (it holds "
                          f"{', '.join(found[:5])}{', ...' if len(found) > 5 else ''}); give the run an empty or new "
                          "folder: another run_name=... or output.root=...")


class RunDir:
    def __init__(self, layout: RunLayout, job: JobConfig, family, encoder, ranks):
        self.layout = layout
        self.path = layout.root
        self.job = job
        self.family = family
        fingerprint = {
            **family.fingerprint(),
            "checkpoint": "tiny" if job.model.path == TINY else "local",  # the demo's tiny one is never a real model
            "model_config_sha256": config_digest(family.checkpoint),
            "weights_sha256": weights_digest(encoder),
            "hidden_size": encoder.hidden_size,
            "model_dtype": job.model.dtype,
            "embed_dtype": job.output.embed_dtype,
            "preprocess_backend": job.preprocess.backend,
            "jpeg_decode": job.decode.jpeg,  # resolved: nvJPEG's pixels are not libjpeg-turbo's
            "jpeg_decoder": decoder_of(job.decode.jpeg, next(encoder.parameters()).device),
            "background": job.preprocess.background,
            "placeholder": job.dataset.placeholder,
            # made ids are the rows' identity; absent where none are made, so runs begun before the key still match
            **({"missing_ids": job.dataset.missing_ids} if job.dataset.missing_ids != "quarantine" else {}),
            **text_fingerprint(job, family),
            "versions": {"batchvlm": batchvlm.__version__, "transformers": transformers.__version__,
                         "torch": torch.__version__},
        }
        # Round-trip through JSON so the comparison with a stored fingerprint sees the same types.
        self.fingerprint = json.loads(json.dumps(fingerprint, sort_keys=True))
        self.fingerprint_digest = hashlib.sha256(json.dumps(self.fingerprint, sort_keys=True).encode()).hexdigest()
        self.path.mkdir(parents=True, exist_ok=True)
        if ranks.is_main:
            self._claim()
        ranks.barrier()
        self._check_fingerprint()

    def _claim(self) -> None:
        """Rank 0 writes the marker, the fingerprint and the starting config of a new run directory."""
        self._check_fingerprint()
        if not self.layout.marker.exists():
            durable_write_json(self.layout.marker, {"batchvlm": batchvlm.__version__, "run": self.path.name})
        if not self.layout.fingerprint.exists():
            durable_write_json(self.layout.fingerprint, self.fingerprint)
        if not self.layout.config.exists():  # the config that started the run; restarts log theirs
            resolved = OmegaConf.to_yaml(OmegaConf.structured(self.job))
            durable_write(self.layout.config, lambda tmp: tmp.write_text(resolved))

    def _check_fingerprint(self) -> None:
        existing = self.layout.fingerprint
        if existing.exists() and (previous := json.loads(existing.read_text())) != self.fingerprint:
            raise ConfigError(f"{self.path} was written with another fingerprint "
                              f"({differences(previous, self.fingerprint)}); "
                              "use another run_name=... for a new run, or delete the directory")

    def schema_metadata(self, hidden_sizes: dict[str, int]) -> dict[str, str]:
        """Every shard's schema metadata. The `huggingface` key repeats the embedding columns' dtype and hidden
        sizes for `datasets`, which keeps no other key (hf_features); a quarantine shard has none of those
        columns, and `datasets` ignores what the key says of columns a file lacks."""
        sizes = {f"{SIZE_KEY}{name}": str(size) for name, size in hidden_sizes.items()}
        embed_dtype = self.job.output.embed_dtype
        return {**sizes, "batchvlm.family": self.family.name, "batchvlm.hidden_size": str(hidden_sizes["image_embeds"]),
                "batchvlm.embed_dtype": embed_dtype, "batchvlm.embedding": self.job.model.embedding,
                "batchvlm.fingerprint": self.fingerprint_digest, "batchvlm.version": batchvlm.__version__,
                "huggingface": features_key(hidden_sizes, embed_dtype)}

    def completed(self) -> dict | None:
        """The totals of a finished run, or None."""
        return read_json(self.layout.success)

    def finish(self, plan, seconds: float, records_seen: int, image_tokens: int) -> dict:
        """Rank 0, once every unit and duplicate bucket is committed: the run's totals (RunTotals), written last
        where the run is complete."""
        manifests = [manifest for manifest in plan.manifests(self.layout) if manifest is not None]
        buckets = bucket_results(self.layout, plan.dedup_buckets)
        totals = RunTotals.of(manifests, buckets)
        summary = {
            "run_dir": str(self.path),
            "units": len(plan.units), "units_committed": totals.units_committed,
            "records_in": totals.records_in, "written": totals.written, "quarantined": totals.quarantined,
            "by_check": totals.by_check,
            "duplicates": {"later_occurrences": totals.later_occurrences, "in_data": totals.duplicates_in_data},
            "files": totals.files, "bytes": totals.bytes,
            "complete": len(manifests) == len(plan.units) and all(buckets),
            "seconds": seconds,
            "records_per_s": records_seen / seconds if seconds else 0.0,
            "tokens_per_s": image_tokens / seconds if seconds else 0.0,
            # images redone on the CPU path, by check, and the parity sample, from every unit's manifest
            **merged_stats([manifest.preprocess for manifest in manifests]),
            "host": platform.node(),
            "checkpoint": self.fingerprint["checkpoint"],
            "family": self.family.name,
        }
        if summary["complete"] and not self.layout.success.exists():
            crash_point("finish.before_success")
            durable_write_json(self.layout.success, summary)
        return summary
