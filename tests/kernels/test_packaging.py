"""kernels/ installs as batchvlm.kernels and never passes for the PyPI `kernels` distribution, which
transformers imports by that name (docs/design.md, Architecture)."""

from __future__ import annotations

import sys

from conftest import REPO


def test_the_tests_do_not_take_the_checkouts_kernels_folder_for_the_distribution():
    import transformers.activations  # noqa: F401  (transformers 5.25 imports the kernels distribution here)

    assert "kernels" not in sys.modules or not str(sys.modules["kernels"].__file__).startswith(str(REPO / "kernels"))
