"""Training on the output: a resumable, rank-aware loader of packed sequences, and interop helpers."""

from batchvlm.training.interop import DatasetRows, load_run_dataset, minimax_h3_token_types, mm_token_type_ids
from batchvlm.training.loader import LoaderConfig, PackedLoader, RunIndex, packing_efficiency
from batchvlm.training.model_inputs import PaddedBatch, model_inputs, pad
from batchvlm.training.reader import RunNotFinished
from batchvlm.training.serving import serving_requests
from batchvlm.training.packing import IGNORE_INDEX, PackedBatch, PackingError, first_fit_decreasing, pack

__all__ = ["DatasetRows", "IGNORE_INDEX", "LoaderConfig", "PackedBatch", "PackedLoader", "PackingError", "PaddedBatch",
           "RunIndex", "RunNotFinished", "first_fit_decreasing", "load_run_dataset", "minimax_h3_token_types",
           "mm_token_type_ids",
           "model_inputs", "pack", "packing_efficiency", "pad", "serving_requests"]
