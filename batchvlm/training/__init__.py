"""Training on the output: a resumable, rank-aware loader of packed sequences, and interop helpers."""

from batchvlm.training.interop import DatasetRows, load_run_dataset, mm_token_type_ids, vllm_qwen2_vl_image_input
from batchvlm.training.loader import LoaderConfig, PackedLoader, RunIndex, packing_efficiency
from batchvlm.training.reader import RunNotFinished
from batchvlm.training.packing import IGNORE_INDEX, PackedBatch, PackingError, first_fit_decreasing, pack

__all__ = ["DatasetRows", "IGNORE_INDEX", "LoaderConfig", "PackedBatch", "PackedLoader", "PackingError", "RunIndex",
           "RunNotFinished", "first_fit_decreasing", "load_run_dataset", "mm_token_type_ids", "pack",
           "packing_efficiency", "vllm_qwen2_vl_image_input"]
