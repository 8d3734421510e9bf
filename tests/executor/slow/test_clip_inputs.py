"""Clips from the inputs outside the llava/messages formats (issue 31, item 1), through the embed job in this process
with Qwen2-VL: WebDataset samples whose clip is a `.mp4`/`.webm`/`.mkv` member beside their `.txt` (and `.jpg`), and
the same captioned clips as a Parquet column of bytes (dataset.format=text, dataset.videos_column). The ids and grids
are held to the checkpoint's Qwen2VLProcessor on the caption with every frame of the clip (it samples them itself);
the two sources store the same rows; a member over video.max_bytes is quarantined unread, a caption whose `<video>`
has no clip under text.placeholder_count."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import av
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import embed_in_process
from PIL import Image

from batchvlm.families import ModelConfig, load_family
from batchvlm.format.schema import VIDEO
from clips import make_clip
from photos import photo_of_size

pytestmark = pytest.mark.slow

CLIPS = {"mp4": (31, 10, 112, 168, "libx264", "mp4"), "webm": (12, 4, 140, 100, "libvpx", "webm"),
         "mkv": (16, 8, 64, 96, "libvpx-vp9", "matroska")}
"""member part -> (frames, fps, height, width, codec, container)."""
SAMPLES = [  # key, caption, clip part, with a photo
    ("s0", "<video> a bar fades", "mp4", False),
    ("s1", "<video> then <image>", "webm", True),
    ("s2", "<video> in Matroska", "mkv", False),
    ("s3", "<video> too many bytes", "big", False),
    ("s4", "<video> with no clip", None, False),
]


def clip_bytes() -> dict[str, bytes]:
    made = {part: make_clip(frames, fps=fps, height=height, width=width, codec=codec, container=container)
            for part, (frames, fps, height, width, codec, container) in CLIPS.items()}
    made["big"] = make_clip(120, fps=10, height=240, width=320)
    return made


def photo_jpeg() -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(photo_of_size(70, 120)).save(buffer, format="JPEG", quality=95)
    return buffer.getvalue()


def write_inputs(folder: Path) -> tuple[Path, Path, int]:
    """The samples as a WebDataset shard and as a Parquet file of bytes; and a video.max_bytes between the small
    clips and the big one."""
    clips, photo = clip_bytes(), photo_jpeg()
    limit = max(len(clips[part]) for part in CLIPS) + 1
    assert len(clips["big"]) > limit
    with tarfile.open(folder / "shard-000.tar", "w") as tar:
        for key, caption, part, with_photo in SAMPLES:
            members = {"txt": caption.encode()}
            if part is not None:
                members["mkv" if part == "mkv" else "mp4" if part == "big" else part] = clips[part]
            if with_photo:
                members["jpg"] = photo
            for suffix, data in members.items():
                info = tarfile.TarInfo(f"{key}.{suffix}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    rows = [{"id": key, "text": caption, "images": [photo] if with_photo else [],
             "videos": [clips[part]] if part is not None else []} for key, caption, part, with_photo in SAMPLES]
    schema = pa.schema([("id", pa.string()), ("text", pa.string()), ("images", pa.list_(pa.binary())),
                        ("videos", pa.list_(pa.binary()))])
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), folder / "clips.parquet")
    return folder / "shard-000.tar", folder / "clips.parquet", limit


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("inputs")
    shard, parquet, limit = write_inputs(folder)
    root = tmp_path_factory.mktemp("outputs")
    common = ["model=qwen2_vl_tiny", f"video.max_bytes={limit}", "checks.max_quarantine_fraction=0.9"]
    webdataset = embed_in_process(root, "webdataset", "dataset=webdataset", f"dataset.path={shard}",
                                  "dataset.videos_column='mp4;webm;mkv'", *common)
    from_parquet = embed_in_process(root, "parquet", "dataset=parquet", f"dataset.path={parquet}",
                                    "dataset.videos_column=videos", *common)
    return webdataset, from_parquet


def rows_of(run: Path, kind: str) -> dict[str, dict]:
    return {row["id"]: row for path in sorted((run / kind).rglob("*.parquet"))
            for row in pq.read_table(path).to_pylist()}


def every_frame(data: bytes) -> np.ndarray:
    with av.open(io.BytesIO(data)) as container:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])


def reference_inputs(qwen, caption: str, clip: bytes, part: str, photo: bytes | None) -> dict:
    """The checkpoint's Qwen2VLProcessor on the caption (each placeholder as the template writes it) with every
    frame of the clip, sampled by its own video processor."""
    from transformers import AutoImageProcessor, AutoVideoProcessor, Qwen2VLProcessor
    from transformers.video_utils import VideoMetadata

    processor = Qwen2VLProcessor(image_processor=AutoImageProcessor.from_pretrained(qwen.checkpoint),
                                 video_processor=AutoVideoProcessor.from_pretrained(qwen.checkpoint),
                                 tokenizer=qwen.tokenizer)
    text = caption.replace("<video>", "<|vision_start|><|video_pad|><|vision_end|>").replace(
        "<image>", "<|vision_start|><|image_pad|><|vision_end|>")
    frames, fps, height, width = CLIPS[part][:4]
    metadata = VideoMetadata(total_num_frames=frames, fps=fps, height=height, width=width, duration=frames / fps)
    images = [np.asarray(Image.open(io.BytesIO(photo)).convert("RGB"))] if photo else None
    return processor(text=[text], images=images, videos=[torch.from_numpy(every_frame(clip)).permute(0, 3, 1, 2)],
                     videos_kwargs={"video_metadata": [metadata], "do_sample_frames": True,
                                    "fps": qwen.video_params.fps, "cap_pixels_per_frame": True}, return_tensors="pt")


def test_webdataset_clip_members_are_laid_out_as_the_checkpoints_processor_lays_out_their_captions(runs):
    webdataset, _ = runs
    rows = rows_of(webdataset, "data")
    assert set(rows) == {"s0", "s1", "s2"}
    qwen = load_family(ModelConfig(family="qwen2_vl"))
    clips, photo = clip_bytes(), photo_jpeg()
    for key, caption, part, with_photo in SAMPLES[:3]:
        row = rows[key]
        expected = reference_inputs(qwen, caption, clips[part], part, photo if with_photo else None)
        assert row["input_ids"] == expected["input_ids"][0].tolist(), key
        assert row["video_grid_thw"] == expected["video_grid_thw"].tolist()
        assert (np.array(row["token_tags"]) == VIDEO).sum() == row["video_num_tokens"][0]
        if with_photo:
            assert row["grid_thw"] == expected["image_grid_thw"].tolist()
        assert row["video_embeds"] is not None and row["position_ids"] is not None


def test_a_parquet_column_of_clip_bytes_stores_what_the_webdataset_members_do(runs):
    webdataset, from_parquet = runs
    ours, twins = rows_of(webdataset, "data"), rows_of(from_parquet, "data")
    assert set(ours) == set(twins)
    for key, row in ours.items():
        twin = twins[key]
        differ = [column for column in row if column not in ("source", "row") and row[column] != twin[column]]
        assert differ == [], key


def test_a_member_over_the_byte_limit_and_a_placeholder_without_a_clip_are_quarantined(runs):
    for run in runs:
        quarantined = rows_of(run, "quarantine")
        assert quarantined["s3"]["check"] == "video.too_many_bytes" and quarantined["s3"]["video_index"] == 0
        assert quarantined["s4"]["check"] == "text.placeholder_count"
        assert "video placeholder" in quarantined["s4"]["message"]
