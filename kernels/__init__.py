"""Triton kernels for GPU preprocessing, installed as `batchvlm.kernels` (pyproject.toml maps the
folder), never as a top-level `kernels`: that is a PyPI distribution transformers probes for by
import name (`is_kernels_available`).

- `reference`: the pixel contract in plain torch ops (the `torch` backend, and the kernels' oracle).
- `taps`: PIL's antialias filter taps as index/weight tables, computed on the host.
- `pack_pixels`: the two Triton kernels that preprocess a batch of mixed-size images straight into
  the family's packed patch layout. Imported on first use only, because Triton decides at
  definition time whether a kernel is compiled or interpreted (`TRITON_INTERPRET=1`).
"""
