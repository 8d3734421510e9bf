"""Kimi-K2.5 clips through the embed job, end to end (issue 31): LLaVA records with a clip and an image, two clips, a
cut clip and a clip without its placeholder, run in this process (its DataLoader worker and isolated decoder as the job
starts them) with the tiny Kimi-K2.5 checkpoint, in fp32 and as users run it (bf16 tower and output). Each stored
value is held to an oracle no one here wrote: the ids to
transformers' Kimi_K25Processor (apply_chat_template, then its expansion of each chunk and the image) on the frames
the rule samples, `video_grid_thw` to its video processor, the stored chunk tokens to Kimi_K25Model's own
get_video_features (from_pretrained) on that processor's pixels."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import embed_in_process
from PIL import Image
from test_video_job import RECORDS, blocks, rows_of, write_dataset

from batchvlm.families import ModelConfig, load_family
from batchvlm.format.schema import FRAME, VIDEO
from batchvlm.pipeline.video import VideoConfig, decode_frames, probe

pytestmark = pytest.mark.slow

CLIPS = {"a.mp4": (31, 10, 64, 96), "b.mp4": (25, 10, 90, 50)}
"""name -> (frames, fps, height, width): 6 sampled frames (chunks of 4 and 2), and 5 (4 and 1). The records are the
Qwen clip run's: a clip after a space too, where the reference tokenizes the text before it with its first chunk's
time."""


RUNS = {"float32": ["output.embed_dtype=float32"],
        "bfloat16": ["output.embed_dtype=bfloat16", "model.dtype=bfloat16"]}  # as users run it
TOLERANCE = {"float32": 1e-3, "bfloat16": 3e-2}
"""Largest difference from the fp32 model's own output, relative to its largest value: fp32, or bf16's 8 bits."""


@pytest.fixture(scope="module", params=list(RUNS))
def kimi_run(request, tmp_path_factory):
    dataset = write_dataset(tmp_path_factory.mktemp("clips"), CLIPS)
    folder = dataset.parent
    root = tmp_path_factory.mktemp("outputs")
    run = embed_in_process(root, "clips", "dataset=llava", f"dataset.path={dataset}",
                           "model=kimi_k25_tiny", *RUNS[request.param], "preprocess.backend=torch",
                           "checks.max_quarantine_fraction=0.9")
    return folder, run, request.param



def sampled(path: Path, family) -> tuple[list[int], float, np.ndarray]:
    data = path.read_bytes()
    header = probe(data, VideoConfig())
    indices = family.video_sampler()(header.frames, header.fps)
    return indices, header.fps, decode_frames(data, header, indices, VideoConfig()).frames


def reference_inputs(family, folder: Path, record: dict) -> dict:
    """transformers' Kimi_K25Processor on the record: its chat template over the turns as messages, then its
    expansion of each clip (the frames the rule samples, with their metadata) and the image."""
    from transformers import Kimi_K25Processor, Kimi_K25VideoProcessor
    from transformers.video_utils import VideoMetadata

    params, video = family.params, family.video_params
    video_processor = Kimi_K25VideoProcessor(
        patch_size=params.patch_size, merge_size=params.merge_size, max_patches=video.in_patch_limit_each_frame,
        temporal_patch_size=video.temporal_merge_kernel_size, do_sample_frames=False,
        size={"max_height": params.max_patches_per_side, "max_width": params.max_patches_per_side},
        image_mean=list(params.image_mean), image_std=list(params.image_std))
    processor = Kimi_K25Processor(image_processor=family.reference_processor(), tokenizer=family.tokenizer,
                                  video_processor=video_processor, chat_template=family.tokenizer.chat_template)
    messages = [{"role": {"human": "user", "gpt": "assistant"}[turn["from"]], "content": blocks(turn["value"])}
                for turn in record["conversations"]]
    videos = [record["video"]] if isinstance(record["video"], str) else record["video"]
    images = [record["image"]] if isinstance(record["image"], str) else record["image"]
    clips = [sampled(folder / name, family) for name in videos]
    return processor(text=[processor.apply_chat_template(messages, tokenize=False)],
                     images=[np.asarray(Image.open(folder / name)) for name in images] or None,
                     videos=[torch.from_numpy(frames).permute(0, 3, 1, 2) for _, _, frames in clips],
                     video_metadata=[VideoMetadata(total_num_frames=CLIPS[name][0], fps=fps, frames_indices=indices)
                                     for name, (indices, fps, _) in zip(videos, clips)], return_tensors="pt")


def test_clips_and_an_image_are_stored_as_kimi_k25s_processor_and_model_give_them(kimi_run):
    from transformers import Kimi_K25ForConditionalGeneration

    from hf_models import pretrained

    folder, run, dtype = kimi_run
    family = load_family(ModelConfig())
    rows = rows_of(run, "data")
    assert set(rows) == {"clip_and_image", "two_clips"}
    model = pretrained(family.checkpoint, Kimi_K25ForConditionalGeneration, dtype=torch.float32)
    for record in RECORDS[:2]:
        row, reference = rows[record["id"]], reference_inputs(family, folder, record)
        assert row["input_ids"] == reference["input_ids"][0].tolist(), record["id"]
        # a grid, a span and tokens per chunk; the frames and their times per clip
        assert row["video_grid_thw"] == reference["video_grid_thw"].tolist(), record["id"]
        assert [span["length"] for span in row["video_spans"]] == row["video_num_tokens"] == [
            h * w // 4 for _, h, w in row["video_grid_thw"]]
        assert row["second_per_grid_ts"] is None
        with torch.inference_mode():
            theirs = torch.cat(model.model.get_video_features(reference["pixel_values_videos"],
                                                             reference["video_grid_thw"]).pooler_output)
        ours = torch.frombuffer(bytearray(row["video_embeds"]), dtype=getattr(torch, dtype)).view(
            -1, theirs.shape[-1]).float()
        assert ours.shape == theirs.shape and sum(row["video_num_tokens"]) == len(ours)
        assert (ours - theirs).abs().max() <= TOLERANCE[dtype] * theirs.abs().max(), record["id"]
        tags, mask = np.asarray(row["token_tags"]), np.asarray(row["loss_mask"])
        for span in row["video_spans"]:
            start, length = span["start"], span["length"]
            assert tags[start - 1:start + length + 1].tolist() == [FRAME] + [VIDEO] * length + [FRAME]
        assert (tags == VIDEO).sum() == sum(row["video_num_tokens"]) and not mask[tags == VIDEO].any()
        assert not mask[tags == FRAME].any() and mask.any()
        videos = [record["video"]] if isinstance(record["video"], str) else record["video"]
        for indices, times, name in zip(row["video_frame_indices"], row["video_frame_times"], videos):
            assert indices == sampled(folder / name, family)[0]
            assert times == pytest.approx([i / CLIPS[name][1] for i in indices])


def test_a_truncated_clip_and_a_clip_without_its_placeholder_are_quarantined_naming_the_clip(kimi_run):
    _, run, _ = kimi_run
    quarantined = rows_of(run, "quarantine")
    assert {key: row["check"] for key, row in quarantined.items()} == {
        "truncated": "video.truncated", "unplaced": "text.placeholder_count"}
    assert quarantined["truncated"]["video_index"] == 0
    assert [Path(path).name for path in quarantined["truncated"]["video_paths"]] == ["cut.webm"]


def test_the_packed_loader_puts_each_chunk_token_row_where_its_token_is(kimi_run):
    from batchvlm.training.packing import pack
    from batchvlm.training.reader import read_run

    _, run, dtype = kimi_run
    stored = {record.id: record for record in read_run(run)}
    batch = pack([stored["two_clips"], stored["clip_and_image"]], 4096)
    assert batch.video_embeds is not None and len(batch.video_embeds) == (batch.token_tags == VIDEO).sum()
    rows = rows_of(run, "data")
    hidden = batch.video_embeds.shape[-1]
    first = torch.frombuffer(bytearray(rows["two_clips"]["video_embeds"]), dtype=getattr(torch, dtype)).view(-1, hidden)
    assert torch.equal(batch.video_embeds[:len(first)], first)


def test_the_estimate_sizes_kimi_clip_records_from_their_headers_alone(kimi_run):
    """batchvlm-estimate on the same records: each clip probed and sampled, none decoded, planned in chunks as the job
    plans them; the bad records quarantined as the job does."""
    from batchvlm.rundir.sink import OutputConfig
    from batchvlm.sizing.estimate import EstimateConfig, estimate
    from batchvlm.sources.config import dataset_config

    folder, run, _ = kimi_run
    result = estimate(EstimateConfig(
        dataset=dataset_config(kind="json", format="llava", images_column="image", text_column="conversations",
                               path=str(folder / "llava.json")),
        model=ModelConfig(), output=OutputConfig(embed_dtype="float32"), records=len(RECORDS)))
    assert result.sampled == len(RECORDS) and result.quarantined == 2
    written = rows_of(run, "data")
    assert result.data_bytes_per_record > min(len(row["video_embeds"]) for row in written.values())


def test_a_stored_kimi_clip_row_trains_with_the_loss_the_model_gives_on_its_pixels(kimi_run):
    """training.model_inputs on the stored rows (the chunks' tokens as `mm_encoder_outputs["video"]`) against the
    model's own forward on the processor's `pixel_values_videos` and `pixel_values`, with the same labels. The tiny
    checkpoint's config.json states no video_token_id: the model is told the tokenizer's, as a trainer would."""
    from transformers import Kimi_K25ForConditionalGeneration

    from batchvlm.training.model_inputs import model_inputs
    from batchvlm.training.packing import pack
    from batchvlm.training.reader import read_run
    from hf_models import pretrained

    folder, run, dtype = kimi_run
    family = load_family(ModelConfig())
    model = pretrained(family.checkpoint, Kimi_K25ForConditionalGeneration, dtype=torch.float32)
    model.config.video_token_id = family.video_token_id
    stored = {record.id: record for record in read_run(run)}
    for record in RECORDS[:2]:
        batch = pack([stored[record["id"]]], 4096)
        reference = reference_inputs(family, folder, record)
        pixels = {key: reference[key] for key in ("pixel_values", "image_grid_thw", "pixel_values_videos",
                                                  "video_grid_thw") if key in reference}
        with torch.inference_mode():
            ours = model(**model_inputs(model, batch)).loss
            theirs = model(input_ids=reference["input_ids"], **pixels, labels=batch.labels, use_cache=False).loss
        within = 1e-4 if dtype == "float32" else 1e-2
        assert torch.isfinite(ours) and abs(float(ours) - float(theirs)) <= within * abs(float(theirs)), record["id"]


def test_the_demos_clips_embed_with_kimi_k25_and_its_cut_clip_is_quarantined_with_its_check(tmp_path):
    """`dataset=demo_clips` with the default family (the tiny Kimi-K2.5): every clip in chunks, a grid and a span
    per chunk; the clip cut short quarantined as video.truncated."""
    run = embed_in_process(tmp_path, "demo-clips", "dataset=demo_clips", "preprocess.backend=torch")
    written, quarantined = rows_of(run, "data"), rows_of(run, "quarantine")
    assert set(written) == {"astronaut_pan", "coffee_zoom_and_cat", "moon_and_astronaut"}
    assert {key: row["check"] for key, row in quarantined.items()} == {"bad_cut_short": "video.truncated"}
    for row in written.values():
        frames = [len(indices) for indices in row["video_frame_indices"]]
        chunk_frames = [min(4, n - start) for n in frames for start in range(0, n, 4)]
        assert len(row["video_grid_thw"]) == len(row["video_spans"]) == len(chunk_frames)
        assert [t for t, _, _ in row["video_grid_thw"]] == chunk_frames
