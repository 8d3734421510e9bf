"""Fault points: off unless BATCHVLM_FAULTS names them; a crash point exits as a SIGKILL would, on the n-th hit."""

from __future__ import annotations

from batchvlm.faults import crash_point, fault


def test_without_the_variable_no_point_fires(monkeypatch):
    monkeypatch.delenv("BATCHVLM_FAULTS", raising=False)
    assert fault("decode.crash") is None
    crash_point("commit.before_manifest")  # returns


def test_a_fault_reads_its_value_from_the_variable(monkeypatch):
    monkeypatch.setenv("BATCHVLM_FAULTS", "decode.hang=ab12, crash.decode=3")
    assert (fault("decode.hang"), fault("crash.decode"), fault("decode.crash")) == ("ab12", "3", None)
