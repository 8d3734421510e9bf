"""batchvlm: precompute vision features for VLM training, checked, quarantined, written to Parquet."""

__version__ = "0.1.0"

__all__ = ["RecordTensors", "read_run", "read_shard", "__version__"]


def __getattr__(name: str):
    """The readers, imported when first asked for (PEP 562): every command imports this package first, and those that
    read a run's metadata alone (`status`, `verify`) need not import torch, which the readers do."""
    if name in ("RecordTensors", "read_run", "read_shard"):
        from batchvlm.training import reader

        return getattr(reader, name)
    raise AttributeError(f"module 'batchvlm' has no attribute {name!r}")
