"""The fingerprint changes with every setting that changes what is written, and with no other."""

from __future__ import annotations

import dataclasses

import pytest

from batchvlm.config import Effect, declared
from batchvlm.executor.fingerprint import run_fingerprint
from batchvlm.sources.config import SCHEMAS, ParquetDataset
from test_fingerprint import OTHER, _example, base_job, changed
import test_fingerprint

# the tiny tower loaded, and a fingerprint computed for every config key
pytestmark = pytest.mark.slow
parts = test_fingerprint.parts  # test_fingerprint.py's fixture (built again here, in under a second)


def test_the_fingerprint_changes_with_every_written_setting_and_with_no_other(parts):
    family, encoder, template = parts
    keys = {key: effect for kind in SCHEMAS.values()
            for key, effect in declared(dataclasses.replace(base_job("", template), dataset=_example(kind))).items()}
    assert set(keys) == set(OTHER) | {"dataset.kind"}, "give every new key another value in OTHER"
    moved = set()
    for key, value in OTHER.items():
        job = base_job(key, template)
        if run_fingerprint(changed(job, key, value), family, encoder) != run_fingerprint(job, family, encoder):
            moved.add(key)
    written = {key for key, effect in keys.items() if effect is Effect.WRITTEN}
    assert moved == written - {"dataset.kind"}
    # the kind of input is its schema's own: another kind, another fingerprint
    job = base_job("", template)
    parquet = dataclasses.replace(job, dataset=ParquetDataset(path="/data.json", format="llava"))
    assert run_fingerprint(parquet, family, encoder) != run_fingerprint(job, family, encoder)
