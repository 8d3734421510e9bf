"""A record's clips in the worker (executor.worker.prepare): decoded with the family's sampler, planned, laid out and
positioned beside its images; a clip that fails its decode quarantines the record, naming the clip; frames cross to
the main process in the chunk's shared block as an image's pixels do."""

from __future__ import annotations

import pytest

from batchvlm.executor.config import JobConfig
from batchvlm.executor.transport import shared, unchunked
from batchvlm.executor.worker import prepare, text_side_of
from batchvlm.families import ModelConfig, load_family
from batchvlm.pipeline.decode import DecodeConfig, Decoder
from batchvlm.records import ImageRef, PreparedRecord, QuarantinedRecord, SourceRecord
from batchvlm.sources.config import dataset_config
from batchvlm.sources.conversations import read_turns
from clips import make_clip

TURNS = [{"from": "human", "value": "<video> then <video>: what changes?"}, {"from": "gpt", "value": "The light."}]


@pytest.fixture(scope="module")
def parts():
    family = load_family(ModelConfig(family="qwen2_vl"))
    job = JobConfig(dataset=dataset_config("json", path="/data.json", format="llava"), model=ModelConfig(
        family="qwen2_vl"), decode=DecodeConfig(isolation="none"))
    return family, job, text_side_of(family, job)


def record_with(clips: list[bytes]) -> SourceRecord:
    return SourceRecord(id="r", unit_id="u", source="s", row=0, text="", images=[],
                        videos=[ImageRef(data=clip) for clip in clips], turns=read_turns("llava", TURNS, "<image>", 0))


def test_a_records_clips_are_decoded_planned_and_laid_out_in_order(parts):
    family, job, text = parts
    clips = [make_clip(12, fps=4, height=56, width=84), make_clip(9, fps=3, height=84, width=56)]
    prepared = prepare(record_with(clips), family, job, Decoder(job.decode, job.video), text)
    assert isinstance(prepared, PreparedRecord) and len(prepared.clips) == 2 and prepared.plans == []
    first, second = prepared.clip_plans
    assert prepared.clips[0].pixels.shape[0] == len(first.indices) == 6  # 12 frames at 4 fps, 2 a second
    assert [length for _, length in prepared.layout.video_spans] == [first.num_tokens, second.num_tokens]
    assert prepared.layout.video_spans[0][0] < prepared.layout.video_spans[1][0]
    assert prepared.layout.position_ids.shape == (3, len(prepared.layout.input_ids))
    assert prepared.num_patches == first.num_patches + second.num_patches


def test_a_clip_that_fails_to_decode_quarantines_its_record_naming_the_clip(parts):
    family, job, text = parts
    quarantined = prepare(record_with([make_clip(12, fps=4), b"<html>not a clip</html>" * 10]), family, job,
                          Decoder(job.decode, job.video), text)
    assert isinstance(quarantined, QuarantinedRecord)
    assert (quarantined.failure.check, quarantined.failure.video_index) == ("video.unreadable", 1)
    assert quarantined.failure.image_index is None


def test_a_clips_frames_cross_to_the_main_process_in_the_chunks_shared_block(parts):
    family, job, text = parts
    prepared = prepare(record_with([make_clip(12, fps=4), make_clip(8, fps=4)]), family, job,
                       Decoder(job.decode, job.video), text)
    frames = [clip.pixels.copy() for clip in prepared.clips]
    chunk = shared([prepared])
    assert all(clip.pixels is None for clip in prepared.clips) and len(chunk.places) == 2
    (arrived,) = list(unchunked([chunk]))
    assert [clip.pixels.numpy().tolist() == before.tolist() for clip, before in zip(arrived.clips, frames)] == [
        True, True]
