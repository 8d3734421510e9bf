"""The kernels compile for a real GPU (PTX for sm_90) even where none is: the interpreter that runs
tests/kernels/test_pack_pixels.py on CPU accepts code that Triton's compiler refuses (e.g. non-constexpr globals).
In a subprocess, because TRITON_INTERPRET must be unset when the kernels are defined."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from batchvlm.kernels import pack_pixels as k

target = GPUTarget("cuda", 90, 32)
tables = {"meta_ptr": "*i64", "block_image_ptr": "*i64", "block_offset_ptr": "*i64", "start_ptr": "*i64",
          "weight_ptr": "*fp32", "taps": "i32"}
horizontal = {"buffer_ptr": "*u8", **tables, "BLOCK": "constexpr"}
triton.compile(ASTSource(k._horizontal_pass, horizontal, {"BLOCK": k.BLOCK}), target=target)
vertical = {"buffer_ptr": "*u8", "out_ptr": "*fp32", **tables, "scale_ptr": "*fp32", "bias_ptr": "*fp32",
            "background": "fp32", **dict.fromkeys(["LAYOUT", "P", "M", "TPS", "CHESSBOARD", "BLOCK"], "constexpr")}
# the specialisations the job launches: raster layouts with M=1 (pack_images), Qwen's merge windows with M=2
for layout, patch, merge, tps in ((0, 14, 1, 1), (1, 14, 2, 2), (1, 16, 2, 2), (2, 16, 1, 1)):
    for chessboard in (False, True):
        constants = {"LAYOUT": layout, "P": patch, "M": merge, "TPS": tps, "CHESSBOARD": chessboard,
                     "BLOCK": k.BLOCK}
        triton.compile(ASTSource(k._vertical_pass_and_pack, vertical, constants), target=target)
print("compiled")
"""


@pytest.mark.slow
def test_kernels_compile_for_the_gpu_in_every_layout():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-3000:]
