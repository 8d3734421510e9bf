"""A family is one module and one YAML: a family written outside batchvlm (plugins/framed_moonvit.py, with its YAML
under plugins/conf/model/) runs the demo job, and the per-family tests run over it as over the shipped ones."""

from __future__ import annotations

import json

import pytest
from conftest import PLUGIN_FAMILY, PLUGIN_SEARCHPATH, run_embed

from batchvlm.families import ModelConfig
from batchvlm.families import load_family
from batchvlm.training.reader import read_run


@pytest.mark.slow
def test_a_family_from_outside_batchvlm_embeds_the_demo_with_its_own_prompt_contract(tmp_path):
    result = run_embed(f"output.root={tmp_path}", "run_name=plugin", PLUGIN_SEARCHPATH, f"model={PLUGIN_FAMILY}")
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "plugin"
    assert json.loads((run / "fingerprint.json").read_text())["family"] == PLUGIN_FAMILY
    family = load_family(ModelConfig(family=PLUGIN_FAMILY))
    records = {record.id: record for record in read_run(run)}
    astronaut = records["astronaut"]
    start, length = astronaut.image_spans[0].tolist()
    head = family.tokenizer.decode(astronaut.input_ids[:start].tolist())
    assert head.endswith("image<|media_content|>") and astronaut.image_embeds.shape[0] == length
    assert len(records) >= 15  # every good demo record: the job's checks hold for a family it did not ship
