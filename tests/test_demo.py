"""The embedded demo builds quietly, and without its extra says which to install."""

from __future__ import annotations

import sys

import pytest

from batchvlm.config import ConfigError
from batchvlm.demo import MEDIA_TOKENS, build_tokenizer, photographs


def test_building_the_demo_tokenizer_writes_nothing_to_stdout_or_stderr(capfd):
    tokenizer = build_tokenizer(["An astronaut in a white suit.", "A cup of coffee on a saucer."], MEDIA_TOKENS)
    assert tokenizer.convert_tokens_to_ids("<|media_pad|>") is not None
    assert capfd.readouterr() == ("", "")  # off a terminal, the BPE trainer's bars were three blank lines


def test_the_demo_without_scikit_image_names_the_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "skimage", None)  # as in an install without the demo extra
    with pytest.raises(ConfigError, match=r"pip install 'batchvlm\[demo\]'"):
        photographs()
