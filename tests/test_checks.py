"""The check catalogue: a failure names a check of the catalogue, or nothing is built."""

from __future__ import annotations

import pickle

import pytest

from batchvlm.checks import CATALOGUE, CheckFailed, failure, unexpected_failure


def test_a_failure_without_a_catalogued_check_is_refused():
    with pytest.raises(KeyError, match="source.made_up"):
        failure("source.made_up", "no such check")


def test_a_failure_carries_its_check_its_stage_and_both_sides():
    made = failure("source.missing_image", "no image", expected="at least one", observed="none")
    assert (made.check, made.stage, made.expected, made.observed, made.exception_type) == (
        "source.missing_image", "source", "at least one", "none", "CheckFailed")


def test_an_unexpected_error_is_filed_under_the_stages_catch_all_with_its_type():
    made = unexpected_failure("encode.failed", RuntimeError("CUDA out of memory"), image_index=2)
    assert (made.stage, made.exception_type, made.image_index) == ("encode", "RuntimeError", 2)


def test_a_check_failure_crosses_process_boundaries_whole():
    raised = CheckFailed("decode.truncated", "cut", "whole", "half", image_index=1)
    again = pickle.loads(pickle.dumps(raised))
    assert (again.check, again.message, again.expected, again.observed, again.image_index) == (
        "decode.truncated", "cut", "whole", "half", 1)
    assert all(check.stage in ("source", "decode", "video", "text", "plan", "preprocess", "encode", "assemble")
               for check in CATALOGUE.values())
