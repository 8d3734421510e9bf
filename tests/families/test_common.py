"""What the families share: the tiny checkpoints' tokenizer."""

from __future__ import annotations

from batchvlm.families.common import tiny_tokenizer
from batchvlm.families.kimi_k25 import MEDIA_TOKENS


def test_building_a_tiny_tokenizer_writes_nothing_to_stdout_or_stderr(capfd):
    tokenizer = tiny_tokenizer(MEDIA_TOKENS)
    assert tokenizer.convert_tokens_to_ids("<|media_pad|>") is not None
    assert capfd.readouterr() == ("", "")  # off a terminal, the BPE trainer's bars were three blank lines
