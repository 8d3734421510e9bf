"""Triton kernels for GPU preprocessing, installed as `batchvlm.kernels` (pyproject.toml maps the
folder), never as a top-level `kernels`: that is a PyPI distribution transformers imports by that
name (`is_kernels_available`, then `from kernels import CUDAProperties, ...`).

- `reference`: the pixel contract in plain torch ops (the `torch` backend, and the kernels' oracle).
- `taps`: PIL's antialias filter taps as index/weight tables, computed on the host.
- `pack_pixels`: the two Triton kernels that preprocess a batch of mixed-size images straight into
  the family's packed patch layout. Imported on first use only, because Triton decides at
  definition time whether a kernel is compiled or interpreted (`TRITON_INTERPRET=1`).
"""

if __name__ == "kernels":
    # Imported by that name: the checkout's root is on sys.path (`python -c`, a notebook, `python -m` run there), where
    # this folder comes before the installed distribution. The name is handed to the distribution, which the import
    # then returns (it takes what sys.modules holds once this module has run). The folder keeps its __init__.py:
    # setuptools' editable install finds `batchvlm.kernels` by it.
    import os
    import sys
    from importlib.machinery import PathFinder
    from importlib.util import module_from_spec

    _checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _spec = PathFinder.find_spec(__name__, [entry for entry in sys.path
                                            if os.path.abspath(entry or os.curdir) != _checkout])
    if _spec is None:
        del sys.modules[__name__]
        raise ModuleNotFoundError(f"No module named {__name__!r} (the checkout's kernels/ folder is batchvlm.kernels)",
                                  name=__name__)
    _distribution = module_from_spec(_spec)
    sys.modules[__name__] = _distribution
    _spec.loader.exec_module(_distribution)
