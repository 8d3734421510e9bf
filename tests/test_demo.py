"""The embedded demo builds quietly: stdout is the job's summary and logs, nothing else."""

from __future__ import annotations

from batchvlm.demo import MEDIA_TOKENS, build_tokenizer


def test_building_the_demo_tokenizer_writes_nothing_to_stdout_or_stderr(capfd):
    tokenizer = build_tokenizer(["An astronaut in a white suit.", "A cup of coffee on a saucer."], MEDIA_TOKENS)
    assert tokenizer.convert_tokens_to_ids("<|media_pad|>") is not None
    assert capfd.readouterr() == ("", "")  # off a terminal, the BPE trainer's bars were three blank lines
