"""batchvlm: precompute vision features for VLM training, checked, quarantined, written to Parquet."""

__version__ = "0.1.0"

from batchvlm.training.reader import RecordTensors, read_run, read_shard  # noqa: E402

__all__ = ["RecordTensors", "read_run", "read_shard", "__version__"]
