"""A job refuses what cannot work before any work starts, in one line naming the key, and leaves nothing behind;
what fails during the run (disk full, a signal) ends it in one line too, its workers with it."""

from __future__ import annotations

import pytest
from conftest import REPO, refused_in_process

REAL_MODELS = sorted(p.stem for p in (REPO / "conf" / "model").glob("*.yaml") if not p.stem.endswith("_tiny"))


@pytest.mark.parametrize("model", REAL_MODELS)
def test_a_real_model_config_without_its_checkpoint_fails_at_start_naming_the_key(tmp_path, model):
    assert "model.path is required" in refused_in_process(tmp_path, f"model={model}")


@pytest.mark.parametrize("overrides,key", [(["dataset.text_column=caption"], "dataset.text_column"),
                                           (["dataset=parquet", "dataset.path=/nowhere/*.parquet"], "dataset.path")])
def test_an_input_the_config_does_not_fit_is_refused_leaving_nothing(tmp_path, overrides, key):
    assert key in refused_in_process(tmp_path, *overrides)


@pytest.mark.parametrize("key", ["dataset.images_column", "dataset.id_column", "dataset.text_column",
                                 "dataset.status_column"])
def test_a_column_named_by_an_empty_string_is_refused_naming_its_key(tmp_path, key):
    """`dataset.images_column=''` read no image at all: each record with an image then failed its placeholder count."""
    assert f"{key} must not be empty" in refused_in_process(tmp_path, "dataset=demo_clips", "model=qwen2_vl_tiny",
                                                            f"{key}=''")
