"""The dataset card: every fact from the run (its fingerprint, config, totals and shards), the files listed one by
one, the checkpoint's revision only where huggingface_hub's own download recorded it for the config the run read."""

from __future__ import annotations

import hashlib
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from rows import CURRENT_FORMAT, data_row
from huggingface_hub._local_folder import write_download_metadata

from batchvlm.format.schema import DATA_SCHEMA
from batchvlm.publish.card import (RunFacts, checkpoint_revision, dataset_card, requeue_origin, rows_with_clips,
                                   size_category)
from batchvlm.rundir.layout import RunLayout

FILES = ["data/00000/a.0f.parquet", "data/00000/b.0f.parquet"]
FINGERPRINT = {
    "family": "qwen2_vl", "version": "qwen2_5_vl", "embedding": "auto", "hidden_size": 3584,
    "model_config_sha256": "c" * 64, "weights_sha256": "w" * 64, "tokenizer": "t0k3n", "chat_template_sha256": None,
    "processor": {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "merge_size": 2},
    "jpeg_decoder": "pillow 13.0.0 (libjpeg-turbo), the reference",
    "versions": {"batchvlm": "0.1.0", "transformers": "5.25.0", "torch": "2.14.1"},
}
CONFIG = {"model": {"path": "/shared/ckpt/Qwen2.5-VL-7B-Instruct", "dtype": "bfloat16", "attn_implementation": "auto"},
          "output": {"embed_dtype": "bfloat16"},
          "dataset": {"kind": "webdataset", "path": "s3://bucket/shards/{00000..00009}.tar", "format": "text"}}
TOTALS = {"records_in": 12_345, "written": 12_000, "quarantined": 345, "format_version": 2,
          "by_check": {"decode.truncated": 300, "text.placeholder_count": 45}}


def facts(**changes) -> RunFacts:
    return RunFacts(**{"run_name": "laion-qwen25", "fingerprint": FINGERPRINT, "config": CONFIG, "totals": TOTALS,
                       "embedding_columns": {"image_embeds": 3584}, "revision": "cafe" * 10, **changes})


def header_and_body(card: str) -> tuple[dict, str]:
    _, header, body = card.split("---\n", 2)
    return yaml.safe_load(header), body


def test_the_cards_header_lists_every_data_file_by_name_with_the_license():
    header, _ = header_and_body(dataset_card(facts(), FILES, "cc-by-4.0"))
    assert header["configs"] == [{"config_name": "default", "data_files": [{"split": "train", "path": FILES}]}]
    assert (header["license"], header["size_categories"]) == ("cc-by-4.0", ["10K<n<100K"])
    assert "qwen2_vl" in header["tags"]


def test_the_cards_body_says_which_tower_made_the_features_and_that_they_are_valid_for_it_alone():
    _, body = header_and_body(dataset_card(facts(), FILES, "cc-by-4.0"))
    for fact in ["`qwen2_vl` (`qwen2_5_vl`)", "merger tokens", "hidden size: 3584", "`image_embeds` [rows, 3584]",
                 "raw little-endian `bfloat16` bytes", "`Qwen2.5-VL-7B-Instruct`", f"revision: `{'cafe' * 10}`",
                 f"config.json sha256: `{'c' * 64}`", f"vision weights sha256 (the tensors the tower ran with): "
                 f"`{'w' * 64}`", json.dumps(FINGERPRINT["processor"], sort_keys=True),
                 "records read: 12,345; written (rows of this dataset): 12,000; quarantined: 345",
                 "`decode.truncated`: 300", "`text.placeholder_count`: 45",
                 "`webdataset`, `s3://bucket/shards/{00000..00009}.tar`", "license: `cc-by-4.0`",
                 "batchvlm 0.1.0, torch 2.14.1, transformers 5.25.0; output format 2",
                 "**These features are valid only for this exact tower**"]:
        assert fact in body, fact


def test_a_card_says_so_where_the_revision_is_unknown_or_the_checkpoint_is_the_tiny_demo():
    _, body = header_and_body(dataset_card(facts(revision=None), FILES, "mit"))
    assert "revision: not recorded" in body
    tiny = {**CONFIG, "model": {**CONFIG["model"], "path": "tiny"}}
    _, body = header_and_body(dataset_card(facts(config=tiny), FILES, "mit"))
    assert "**tiny demo checkpoint** (random weights built from a config): not a real model" in body


def test_the_card_of_a_run_is_the_same_text_every_time():
    assert dataset_card(facts(), FILES, "mit") == dataset_card(facts(), FILES, "mit")


def test_the_revision_is_the_one_huggingface_hub_recorded_for_the_config_the_run_read(tmp_path):
    checkpoint = tmp_path / "Qwen2.5-VL-7B-Instruct"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text('{"model_type": "qwen2_5_vl"}')
    digest = hashlib.sha256((checkpoint / "config.json").read_bytes()).hexdigest()
    assert checkpoint_revision(str(checkpoint), digest) is None  # not downloaded by huggingface_hub
    write_download_metadata(checkpoint, "config.json", "a1b2" * 10, "etag")
    assert checkpoint_revision(str(checkpoint), digest) == "a1b2" * 10
    assert checkpoint_revision(str(checkpoint), "0" * 64) is None  # config.json is not the one the run read
    assert checkpoint_revision("tiny", digest) is None


@pytest.mark.parametrize("rows,category", [(0, "n<1K"), (999, "n<1K"), (1000, "1K<n<10K"), (10 ** 9 - 1, "100M<n<1B"),
                                           (10 ** 12, "n>1T")])
def test_size_category_is_the_hubs_bucket(rows, category):
    assert size_category(rows) == category


def test_the_rows_with_clips_are_counted_from_the_footers_null_counts_of_video_embeds(tmp_path):
    """Some rows with a clip and some without, over row groups: the count is of video_embeds' own column (a Parquet
    footer numbers leaf columns, which a struct column before it makes more than the schema's fields)."""
    clips = [b"\x01\x02", None, None, b"\x03\x04", None]
    table = pa.Table.from_pylist([data_row(id=str(row), row=row, video_embeds=clip) for row, clip in enumerate(clips)],
                                 schema=DATA_SCHEMA).replace_schema_metadata(CURRENT_FORMAT)
    shards = [tmp_path / "a.parquet", tmp_path / "b.parquet"]
    pq.write_table(table, shards[0], row_group_size=2)
    pq.write_table(table.slice(0, 1), shards[1])
    assert rows_with_clips([pq.read_metadata(shard) for shard in shards]) == 3


def test_the_card_of_a_requeue_run_says_it_holds_only_the_records_requeued_from_its_run(tmp_path):
    """A requeue run (lineage.json, as `requeue_from=` writes it) holds only the records it read again: pushed alone,
    the card says so and names the run whose rows it lacks."""
    _, body = header_and_body(dataset_card(facts(requeue_from="/shared/outputs/laion-qwen25"), FILES, "cc-by-4.0"))
    assert ("a requeue run of `laion-qwen25` (`/shared/outputs/laion-qwen25`): it holds only the records read again "
            "from that run's quarantine; that run's own rows are not in this dataset") in body
    assert "requeue" not in header_and_body(dataset_card(facts(), FILES, "cc-by-4.0"))[1]
    layout = RunLayout(tmp_path)
    (tmp_path / "lineage.json").write_text(json.dumps({"requeue_from": "/shared/outputs/laion-qwen25", "records": []}))
    assert requeue_origin(layout) == "/shared/outputs/laion-qwen25"
