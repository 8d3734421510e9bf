"""The embedded demo, without its extra, says which to install."""

from __future__ import annotations

import sys

import pytest

from batchvlm.config import ConfigError
from batchvlm.demo import photographs


def test_the_demo_without_scikit_image_names_the_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "skimage", None)  # as in an install without the demo extra
    with pytest.raises(ConfigError, match=r"pip install 'batchvlm\[demo\]'"):
        photographs()
