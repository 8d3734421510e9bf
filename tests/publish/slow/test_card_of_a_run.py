"""The card's facts read from a real run's fingerprint, totals and shards."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from conftest import committed_shards

from batchvlm.publish.card import RunFacts
from batchvlm.rundir.layout import RunLayout
from batchvlm.training.reader import read_run

# the demo job
pytestmark = pytest.mark.slow


def test_the_facts_of_a_run_are_read_from_its_fingerprint_totals_and_shards(siglip_run):
    layout = RunLayout(siglip_run)
    read = RunFacts.of(layout, [pq.read_metadata(shard) for shard in committed_shards(siglip_run)])
    fingerprint = json.loads(layout.fingerprint.read_text())
    assert read.fingerprint == fingerprint and read.totals == json.loads(layout.success.read_text())
    record = next(read_run(siglip_run))
    pooled = record.extras["pooled_embeds"].shape[1]
    assert read.embedding_columns == {"image_embeds": record.image_embeds.shape[1], "pooled_embeds": pooled,
                                      "video_pooled_embeds": pooled}  # a clip's frames' (none in this run)
    assert read.embedding_columns["image_embeds"] == fingerprint["hidden_size"]
    assert (read.run_name, read.revision, read.config["model"]["path"]) == ("siglip", None, "tiny")
    assert read.requeue_from is None and read.clip_rows is None  # no lineage; the demo's texts name no clips
