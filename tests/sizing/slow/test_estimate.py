"""The estimate sizes the job from a sample of its input, without a tower: within 10 % of what the job then writes."""

from __future__ import annotations

import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import embed_in_process, run_job_command
from PIL import Image

from batchvlm.sizing.estimate import EstimateConfig
from batchvlm.sources.config import dataset_config
from batchvlm.sizing.estimate import estimate, format_estimate
from batchvlm.sources import make_source
from clips import make_clip
from batchvlm.rundir.layout import DATA, QUARANTINE, RunLayout
from batchvlm.rundir.manifest import all_manifests

# the job (and the estimate) on real data
pytestmark = pytest.mark.slow


def written_bytes(run_dir) -> int:
    """What the job wrote that the estimate sizes: its data and quarantine shards."""
    return sum(listing.bytes for manifest in all_manifests(RunLayout(run_dir)) for kind in (DATA, QUARANTINE)
               for listing in manifest.shards(kind))


def test_the_estimate_of_the_demo_is_within_ten_percent_of_the_bytes_the_job_writes(demo_run):
    result = estimate(EstimateConfig(dataset=dataset_config("demo", unit_records=6)))
    assert result.records == 21 and result.sampled == 21 and result.units == 4
    assert abs(result.total_bytes / written_bytes(demo_run) - 1) <= 0.10


def mixed_sizes(path, count: int) -> None:
    rng = np.random.default_rng(0)
    images = []
    for index in range(count):
        height, width = int(rng.integers(20, 700)), int(rng.integers(20, 700))
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (height, width, 3), np.uint8)).save(buffer, format="JPEG", quality=70)
        images.append([buffer.getvalue()])
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(count)], "images": images,
                             "text": ["<image> noise"] * count}), path, row_group_size=8)


def test_the_estimate_of_mixed_image_sizes_from_a_sample_is_within_ten_percent(tmp_path):
    mixed_sizes(tmp_path / "mixed.parquet", 48)
    overrides = ["dataset=parquet", f"dataset.path={tmp_path / 'mixed.parquet'}", "dataset.unit_records=8"]
    embed_in_process(tmp_path, "mixed", *overrides)
    sampled = run_job_command("estimate", *overrides, "records=24", "images_per_s=200", "devices=8")
    assert sampled.returncode == 0, sampled.stderr[-3000:]
    report = sampled.stdout
    assert "sample: 24 records" in report and "records: 48 in 6 units" in report and " h, writing " in report
    estimated = estimate(EstimateConfig(dataset=dataset_config("parquet", path=str(tmp_path / "mixed.parquet"),
                                                              unit_records=8), records=24))
    assert abs(estimated.total_bytes / written_bytes(tmp_path / "mixed") - 1) <= 0.10
    assert "tokens per image: p50 " in format_estimate(estimated)


def llava_lines(folder, count: int, images: bool = True) -> str:
    """LLaVA records as JSON Lines, about as long as each other, over three image files (or text only)."""
    (folder / "img").mkdir(exist_ok=True)
    for n in range(3):
        Image.fromarray(np.random.default_rng(n).integers(0, 255, (40, 56, 3), np.uint8)).save(folder / "img" / f"{n}.png")
    lines = []
    for n in range(count):
        turns = [{"from": "human", "value": ("<image> " if images else "") + f"what is {n:06d}?"},
                 {"from": "gpt", "value": "noise " * 8}]
        lines.append(json.dumps({"id": f"r{n}", **({"image": f"img/{n % 3}.png"} if images else {}),
                                 "conversations": turns}) + "\n")
    return "".join(lines)


LLAVA = dict(kind="json", format="llava", images_column="image", text_column="conversations")


@pytest.mark.parametrize("array", [False, True], ids=["json lines", "json array"])
def test_json_records_are_counted_from_their_own_bytes_not_as_tar_members(tmp_path, array):
    text = llava_lines(tmp_path, 20_000)
    path = tmp_path / ("llava.json" if array else "llava.jsonl")
    path.write_text("[" + ",".join(text.splitlines()) + "]" if array else text)
    result = estimate(EstimateConfig(dataset=dataset_config(path=str(path), unit_bytes=200_000, **LLAVA), records=100))
    assert result.units > 5 and abs(result.records / 20_000 - 1) < 0.05


def test_a_small_dataset_read_whole_by_the_sample_is_counted_exactly_and_its_totals_agree(tmp_path):
    path = tmp_path / "llava.json"
    path.write_text("[" + ",".join(llava_lines(tmp_path, 6).splitlines()) + "]")
    result = estimate(EstimateConfig(dataset=dataset_config(path=str(path), **LLAVA), records=32))
    assert result.records == result.sampled == 6 and result.units == 1
    assert result.unit_bytes <= result.total_bytes and result.quarantine_bytes_per_record >= 0
    shown = format_estimate(result)
    assert "sample: 6 records" in shown and "records: 6 in 1 units" in shown and "data per unit (6 records" in shown


def test_a_dataset_with_quarantined_records_sizes_its_quarantine_rows_at_no_negative_bytes(tmp_path):
    text = llava_lines(tmp_path, 40).replace("<image> what is 000003", "<image><image> what is 000003")
    (tmp_path / "llava.jsonl").write_text(text)
    result = estimate(EstimateConfig(dataset=dataset_config(path=str(tmp_path / "llava.jsonl"), **LLAVA), records=40))
    assert (result.sampled, result.quarantined, result.records) == (40, 1, 40)
    assert result.quarantine_bytes_per_record > 0 and result.total_bytes > 0


def test_a_text_only_dataset_is_estimated_without_dividing_by_zero(tmp_path):
    (tmp_path / "text.jsonl").write_text(llava_lines(tmp_path, 50, images=False))
    result = estimate(EstimateConfig(dataset=dataset_config(path=str(tmp_path / "text.jsonl"), **LLAVA), records=50,
                                     images_per_s=100.0))
    assert result.records == 50 and result.images_per_record == 0 and result.tokens_per_image == []
    shown = format_estimate(result)
    assert "tokens per image: no image in the sample" in shown and "no image to embed" in shown


# -- clips: counted from their headers and packets, turned upright by their first frame's display matrix ----------


def clip_records(folder) -> str:
    """LLaVA records of generated clips: a short one, a long one, a 90-degree rotated one, and a record with two."""
    clips = {"short.mp4": make_clip(8, fps=4, height=56, width=84),
             "long.mp4": make_clip(40, fps=4, height=56, width=84),
             "turned.mp4": make_clip(12, fps=4, height=56, width=112, rotation=90)}
    for name, data in clips.items():
        (folder / name).write_bytes(data)
    videos = [["short.mp4"], ["long.mp4"], ["turned.mp4"], ["short.mp4", "turned.mp4"]]
    lines = []
    for n, names in enumerate(videos):
        turns = [{"from": "human", "value": "<video> " * len(names) + "what moves?"},
                 {"from": "gpt", "value": "A bar."}]
        lines.append(json.dumps({"id": f"c{n}", "video": names, "conversations": turns}) + "\n")
    (folder / "clips.jsonl").write_text("".join(lines))
    return str(folder / "clips.jsonl")


@pytest.mark.slow  # the tiny Qwen2-VL loaded twice: about 3 s of CPU, 10 s of wall on a loaded machine
def test_the_estimate_counts_clips_frames_and_video_tokens_as_the_job_decodes_and_plans_them(tmp_path):
    from batchvlm.executor.worker import prepare, text_side_of
    from batchvlm.families import ModelConfig, load_family
    from batchvlm.pipeline.decode import Decoder

    config = EstimateConfig(dataset=dataset_config(path=clip_records(tmp_path), **LLAVA, image_root=str(tmp_path)),
                            model=ModelConfig(family="qwen2_vl"), records=8)
    result = estimate(config)
    family = load_family(config.model)
    source = make_source(config.dataset, max_bytes=config.decode.max_bytes)
    decoder = Decoder(config.decode, config.video)
    try:
        prepared = [prepare(record, family, config, decoder, text_side_of(family, config))
                    for unit in source.plan() for record in source.unit_records(unit)]
    finally:
        decoder.close()
    clips = [(clip, plan) for record in prepared for clip, plan in zip(record.clips, record.clip_plans)]
    assert result.clips_per_record == 5 / 4 and result.quarantined == 0
    assert result.frames_per_clip == sorted(len(clip.indices) for clip, _ in clips) == [4, 4, 6, 6, 20]
    assert result.decoded_per_clip == sorted(max(clip.indices) + 1 for clip, _ in clips)
    assert result.tokens_per_clip == sorted(plan.num_tokens for _, plan in clips)
    assert "clips: 1.25 per record; per clip (p50/p90/max): sampled frames 6/20/20" in format_estimate(result)


def test_a_rotated_clip_is_sized_upright_from_its_header_and_first_frame_as_the_decoder_turns_it():
    from batchvlm.pipeline.decode import DecodeConfig
    from batchvlm.pipeline.video import VideoConfig, decode_clip
    from batchvlm.records import ImageRef
    from batchvlm.sizing.estimate import HeaderReader

    for rotation in (90, 180, 270):
        data = make_clip(12, fps=4, height=56, width=112, rotation=rotation)
        sample = lambda total, fps: [0, 5, 11]  # noqa: E731
        sized = HeaderReader(DecodeConfig(isolation="none")).clip(ImageRef(data=data), 0, sample)
        decoded = decode_clip(data, VideoConfig(), sample)
        assert sized.decoded.frames.shape == decoded.decoded.frames.shape, rotation
        assert sized.decoded.rotation == decoded.decoded.rotation != 0
