"""Token-budget batches: closed before the record that would pass the budget (a clip weighing its frames' patches),
a record over the budget alone and named."""

from __future__ import annotations

import logging

import pytest

from batchvlm.executor.batching import TokenBudgetBatcher
from batchvlm.executor.config import JobConfig
from batchvlm.executor.worker import prepare, text_side_of
from batchvlm.families import ModelConfig, load_family
from batchvlm.pipeline.decode import DecodeConfig, Decoder
from batchvlm.records import ImagePlan, ImageRef, PreparedRecord, SourceRecord
from batchvlm.sources.config import dataset_config
from batchvlm.sources.conversations import read_turns
from clips import make_clip


def record(record_id: str, *patches: int) -> PreparedRecord:
    """A record with one image of `n` patches per argument (a 1 x n grid)."""
    plans = [ImagePlan((n, 1), (n, 1), (n, 1), (1, n, 1), n) for n in patches]
    source = SourceRecord(id=record_id, unit_id="u", source="s.parquet", row=0, text="", images=[])
    return PreparedRecord(source=source, images=[], plans=plans, layout=None)


def ids(records) -> list[str]:
    return [r.source.id for r in records]


def test_a_batch_closes_before_the_record_that_would_pass_the_patch_budget():
    batcher = TokenBudgetBatcher(token_budget=100, max_images=10)
    assert batcher.add(record("a", 40)) is None
    assert batcher.add(record("b", 60)) is None  # exactly the budget still fits
    assert ids(batcher.add(record("c", 1))) == ["a", "b"]
    assert ids(batcher.flush()) == ["c"]


def test_a_batch_closes_before_the_record_that_would_pass_max_images():
    batcher = TokenBudgetBatcher(token_budget=10_000, max_images=3)
    assert batcher.add(record("a", 1, 1)) is None
    assert ids(batcher.add(record("b", 1, 1))) == ["a"]  # 2 + 2 images > 3
    assert ids(batcher.flush()) == ["b"]


def test_a_record_over_the_budget_is_a_batch_of_its_own():
    batcher = TokenBudgetBatcher(token_budget=100, max_images=10)
    assert batcher.add(record("huge", 500)) is None  # an empty batch takes any record
    assert ids(batcher.add(record("small", 5))) == ["huge"]


def test_flush_hands_over_the_open_batch_and_starts_an_empty_one():
    batcher = TokenBudgetBatcher(token_budget=100, max_images=10)
    batcher.add(record("a", 90))
    assert ids(batcher.flush()) == ["a"]
    assert batcher.flush() == []
    assert batcher.add(record("b", 90)) is None  # the budget counts from zero again



# -- clips, made with PyAV and prepared by the worker as the job prepares them ------------------------------------


@pytest.fixture(scope="module")
def clip_parts():
    family = load_family(ModelConfig(family="qwen2_vl"))
    job = JobConfig(dataset=dataset_config("json", path="/data.json", format="llava"),
                    model=ModelConfig(family="qwen2_vl"), decode=DecodeConfig(isolation="none"))
    return family, job, text_side_of(family, job), Decoder(job.decode, job.video)


def clip_record(parts, record_id: str, frames: int) -> PreparedRecord:
    """A LLaVA record of one generated clip of `frames` frames at 4 fps (2 sampled a second), prepared by the worker."""
    family, job, text, decoder = parts
    turns = read_turns("llava", [{"from": "human", "value": "<video> what moves?"}, {"from": "gpt", "value": "A bar."}],
                       "<image>", 0)
    source = SourceRecord(id=record_id, unit_id="u", source="s", row=0, text="", images=[],
                          videos=[ImageRef(data=make_clip(frames, fps=4, height=56, width=84))], turns=turns)
    prepared = prepare(source, family, job, decoder, text)
    assert isinstance(prepared, PreparedRecord), prepared
    return prepared


def test_a_clip_weighs_every_patch_of_its_frames_against_the_budget(clip_parts):
    short, long = clip_record(clip_parts, "short", 8), clip_record(clip_parts, "long", 24)
    per_temporal_patch = 4 * 6  # 56x84 frames: a 4 x 6 patch grid, two frames per temporal patch
    assert (short.num_patches, long.num_patches) == (2 * per_temporal_patch, 6 * per_temporal_patch)
    batcher = TokenBudgetBatcher(token_budget=long.num_patches + 9, max_images=256)
    assert batcher.add(record("image", 10)) is None
    assert ids(batcher.add(long)) == ["image"]  # 10 + 144 patches pass 153 (its 36 tokens, or one image, would not)
    assert ids(batcher.add(short)) == ["long"]
    assert ids(batcher.flush()) == ["short"]


def test_a_clip_over_the_budget_is_encoded_alone_and_named_in_the_log(clip_parts, caplog):
    long = clip_record(clip_parts, "long-clip", 24)
    batcher = TokenBudgetBatcher(token_budget=100, max_images=256)
    assert batcher.add(record("before", 40)) is None
    with caplog.at_level(logging.WARNING, logger="batchvlm"):
        assert ids(batcher.add(long)) == ["before"]
    assert ids(batcher.add(record("after", 40))) == ["long-clip"]
    assert ids(batcher.flush()) == ["after"]
    named = [r.getMessage() for r in caplog.records if "token_budget" in r.getMessage()]
    assert named == ["record long-clip holds 144 patches (clip 0: 144), over preprocess.token_budget=100: it is "
                     "encoded alone, in a batch over the budget"]


def test_a_record_within_the_budget_is_not_named(clip_parts, caplog):
    batcher = TokenBudgetBatcher(token_budget=144, max_images=256)
    with caplog.at_level(logging.WARNING, logger="batchvlm"):
        batcher.add(clip_record(clip_parts, "fits", 24))
    assert not [r for r in caplog.records if "token_budget" in r.getMessage()]
