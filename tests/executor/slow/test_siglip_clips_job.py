"""SigLIP2 clips through the embed job, end to end (issue 31): captioned clips in Parquet (dataset.format=text, a
`videos` column of paths and bytes, `<video>` in the caption), run in this process with its DataLoader worker and
isolated decoder, each stored value held to an oracle no one here wrote: the sampled frames to transformers'
SmolVLMVideoProcessor.sample_frames on the clip's metadata, their times to PyAV's, each frame's grid and pixels to
Siglip2ImageProcessor, the clip's patch tokens and per-frame pooled vectors to Siglip2Model's vision forward
(from_pretrained) on those pixels; a truncated clip and a clip without its placeholder quarantined under their
checks."""

from __future__ import annotations

from pathlib import Path

import av
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import embed_in_process
from hf_models import pretrained
from PIL import Image
from transformers import Siglip2ImageProcessor, Siglip2Model, SmolVLMVideoProcessor
from transformers.video_utils import VideoMetadata

from batchvlm.families import ModelConfig, load_family
from batchvlm.format.schema import FRAME, IMAGE, TEXT, VIDEO
from clips import make_clip
from photos import photo_of_size

pytestmark = pytest.mark.slow

CLIPS = {"a.mp4": (31, 10, 64, 96), "b.webm": (45, 15, 120, 90)}
"""name -> (frames, fps, height, width)."""
CLIP = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


def write_dataset(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, (frames, fps, height, width) in CLIPS.items():
        codec, container = ("libvpx", "webm") if name.endswith("webm") else ("libx264", "mp4")
        (folder / name).write_bytes(make_clip(frames, fps=fps, height=height, width=width, codec=codec,
                                              container=container))
    whole = make_clip(60, codec="libvpx", container="webm")
    (folder / "cut.webm").write_bytes(whole[:len(whole) * 2 // 3])
    Image.fromarray(photo_of_size(70, 120)).save(folder / "photo.png")
    b_bytes = (folder / "b.webm").read_bytes()
    rows = [
        {"id": "clip_and_image", "text": "<video> a bar fades, then <image>", "images": ["photo.png"],
         "videos": [{"bytes": None, "path": "a.mp4"}]},
        {"id": "two_clips", "text": "first <video> then <video>", "images": [],
         "videos": [{"bytes": b_bytes, "path": None}, {"bytes": None, "path": "a.mp4"}]},
        {"id": "image_only", "text": "<image> a photo", "images": ["photo.png"], "videos": []},
        {"id": "truncated", "text": "<video> cut short", "images": [], "videos": [{"bytes": None, "path": "cut.webm"}]},
        {"id": "unplaced", "text": "a clip with no place", "images": [], "videos": [{"bytes": None, "path": "a.mp4"}]},
    ]
    schema = pa.schema([("id", pa.string()), ("text", pa.string()), ("images", pa.list_(pa.string())),
                        ("videos", pa.list_(CLIP))])
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), folder / "clips.parquet")
    return folder / "clips.parquet"


TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}
"""Largest difference from the fp32 model's own output, relative to its largest value: fp32, or bf16's 8 bits."""


@pytest.fixture(scope="module", params=list(TOLERANCE))
def siglip_clip_run(request, tmp_path_factory):
    """fp32, and as users run SigLIP2 (conf/model/siglip2.yaml): a bf16 tower and bf16 output."""
    dataset = write_dataset(tmp_path_factory.mktemp("clips"))
    dtype = request.param
    run = embed_in_process(tmp_path_factory.mktemp("outputs"), "siglip_clips", "dataset=parquet",
                           f"dataset.path={dataset}", "dataset.videos_column=videos", "model=siglip2_tiny",
                           f"model.dtype={dtype}", f"output.embed_dtype={dtype}", "checks.max_quarantine_fraction=0.9")
    return dataset.parent, run, dtype


def rows_of(run: Path, kind: str) -> dict[str, dict]:
    return {row["id"]: row for path in sorted((run / kind).rglob("*.parquet"))
            for row in pq.read_table(path).to_pylist()}


def every_frame(path: Path) -> tuple[np.ndarray, list[float]]:
    """Every frame of a clip and its time, as PyAV decodes them."""
    with av.open(str(path)) as container:
        frames = [(frame.to_ndarray(format="rgb24"), float(frame.time)) for frame in container.decode(video=0)]
    return np.stack([f for f, _ in frames]), [t - frames[0][1] for _, t in frames]


def embeds(row: dict, column: str, hidden: int, dtype: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(row[column]), dtype=getattr(torch, dtype)).view(-1, hidden).float()


def reference_clip(siglip, reference, path: Path):
    """What transformers gives for a clip: SmolVLM's sampled frames on its metadata, Siglip2ImageProcessor's pixels
    and grid per frame, the vision forward's patch tokens and pooled vector per frame."""
    frames, times = every_frame(path)
    total, fps = CLIPS[path.name][:2]
    params = siglip.video_params
    indices = SmolVLMVideoProcessor().sample_frames(
        VideoMetadata(total_num_frames=total, fps=fps, duration=total / fps), num_frames=params.max_frames,
        fps=params.fps, skip_secs=params.skip_secs).tolist()
    processor = Siglip2ImageProcessor(patch_size=16, max_num_patches=params.max_num_patches, image_mean=[0.5] * 3,
                                      image_std=[0.5] * 3)
    out = processor(images=[torch.from_numpy(frames[i]).permute(2, 0, 1) for i in indices], return_tensors="pt")
    with torch.inference_mode():
        forward = reference(pixel_values=out["pixel_values"], pixel_attention_mask=out["pixel_attention_mask"],
                            spatial_shapes=out["spatial_shapes"])
    (h, w), = {tuple(shape) for shape in out["spatial_shapes"].tolist()}
    tokens = forward.last_hidden_state[:, :h * w].reshape(-1, forward.last_hidden_state.shape[-1])
    return indices, [times[i] for i in indices], [len(indices), h, w], tokens, forward.pooler_output


def test_captioned_clips_are_stored_as_transformers_samples_processes_and_encodes_them(siglip_clip_run):
    folder, run, dtype = siglip_clip_run
    rows = rows_of(run, "data")
    assert set(rows) == {"clip_and_image", "two_clips", "image_only"}
    siglip = load_family(ModelConfig(family="siglip2"))
    reference = pretrained(siglip.checkpoint, Siglip2Model, dtype=torch.float32).vision_model
    hidden = reference.config.hidden_size
    for record, names in (("clip_and_image", ["a.mp4"]), ("two_clips", ["b.webm", "a.mp4"])):
        row = rows[record]
        expected = [reference_clip(siglip, reference, folder / name) for name in names]
        assert row["video_frame_indices"] == [indices for indices, *_ in expected]
        assert np.allclose(sum(row["video_frame_times"], []), sum([times for _, times, *_ in expected], []),
                           atol=1e-6)
        assert row["video_grid_thw"] == [grid for _, _, grid, *_ in expected]
        assert row["video_num_tokens"] == [t * h * w for t, h, w in row["video_grid_thw"]]
        tokens, pooled = torch.cat([e[3] for e in expected]), torch.cat([e[4] for e in expected])
        stored = embeds(row, "video_embeds", hidden, dtype)
        stored_pooled = embeds(row, "video_pooled_embeds", hidden, dtype)
        assert stored.shape == tokens.shape and stored_pooled.shape == pooled.shape
        assert float((stored - tokens).abs().max()) <= TOLERANCE[dtype] * float(tokens.abs().max())
        assert float((stored_pooled - pooled).abs().max()) <= TOLERANCE[dtype] * float(pooled.abs().max())
        # one span of clip tokens per clip, framed as an image, in text order; the images' spans as before
        ids, tags = np.array(row["input_ids"]), np.array(row["token_tags"])
        spans = [(span["start"], span["length"]) for span in row["video_spans"]]
        assert [length for _, length in spans] == row["video_num_tokens"]
        for start, length in spans:
            assert set(ids[start:start + length]) == {siglip.video_token_id}
            assert tags[start - 1] == FRAME and tags[start + length] == FRAME
        assert int((tags == VIDEO).sum()) == sum(row["video_num_tokens"])
        assert int((tags == IMAGE).sum()) == row["num_image_tokens"]
        assert set(tags) <= {TEXT, IMAGE, FRAME, VIDEO} and row["position_ids"] is None
    assert spans[0][0] < spans[1][0]
    image_only = rows["image_only"]
    assert all(image_only[column] is None for column in ("video_spans", "video_embeds", "video_pooled_embeds"))
    assert rows["clip_and_image"]["pooled_embeds"] is not None  # the image's own pooled vector, beside the clip's
    # the training readers give both back, each in its shard's declared width
    from batchvlm.training.reader import read_run

    read, row = {record.id: record for record in read_run(run)}["two_clips"], rows["two_clips"]
    assert torch.equal(read.video_embeds.float(), embeds(row, "video_embeds", hidden, dtype))
    assert torch.equal(read.extras["video_pooled_embeds"].float(), embeds(row, "video_pooled_embeds", hidden, dtype))


def test_a_truncated_clip_and_a_clip_without_its_placeholder_are_quarantined_naming_the_clip(siglip_clip_run):
    _, run, _ = siglip_clip_run
    quarantined = rows_of(run, "quarantine")
    assert quarantined["truncated"]["check"] == "video.truncated"
    assert quarantined["truncated"]["video_index"] == 0 and quarantined["truncated"]["image_index"] is None
    assert quarantined["truncated"]["video_paths"][0].endswith("cut.webm")
    assert quarantined["unplaced"]["check"] == "text.placeholder_count"
    assert "video placeholder" in quarantined["unplaced"]["message"]


def test_the_estimate_sizes_siglip_clip_records_from_their_headers_alone(siglip_clip_run):
    """batchvlm-estimate on the same Parquet file: each clip probed and sampled, none decoded; the bad records
    quarantined as the job does; its rows as wide as the job's embeddings (its clips' tokens and pooled vector per
    frame counted: random values, compressed as the job's rows are)."""
    from batchvlm.rundir.sink import OutputConfig
    from batchvlm.sizing.estimate import EstimateConfig, estimate
    from batchvlm.sources.config import dataset_config

    folder, run, dtype = siglip_clip_run
    if dtype != "float32":
        pytest.skip("one estimate is enough")
    result = estimate(EstimateConfig(
        dataset=dataset_config(kind="parquet", path=str(folder / "clips.parquet"), videos_column="videos"),
        model=ModelConfig(family="siglip2"), output=OutputConfig(embed_dtype="float32"), records=5))
    assert result.sampled == 5 and result.quarantined == 2
    written = rows_of(run, "data")
    embedded = sum(len(row[column] or b"") for row in written.values()
                   for column in ("image_embeds", "pooled_embeds", "video_embeds", "video_pooled_embeds"))
    # (Parquet's compression finds a little in random floats: measured 0.95 of the embeddings' bytes)
    assert 0.8 * embedded / len(written) <= result.data_bytes_per_record <= 1.5 * embedded / len(written)


def test_the_demos_captioned_clips_embed_with_siglip2_and_its_cut_clip_is_quarantined(tmp_path):
    """`dataset=demo_captioned_clips model=siglip2_tiny`: the demo's camera moves (mp4 and WebM) captioned, one with
    a photo, one caption with two clips; the clip cut short quarantined as video.truncated."""
    run = embed_in_process(tmp_path, "demo-captions", "dataset=demo_captioned_clips", "model=siglip2_tiny")
    written, quarantined = rows_of(run, "data"), rows_of(run, "quarantine")
    assert set(written) == {"astronaut_pan", "coffee_zoom_and_cat", "moon_and_astronaut"}
    assert [len(row["video_grid_thw"]) for row in map(written.get, sorted(written))] == [1, 1, 2]
    assert all(len(row["video_pooled_embeds"]) == sum(t for t, _, _ in row["video_grid_thw"]) * 32 * 2
               for row in written.values())  # a pooled vector per frame, 32 wide, in bf16 (siglip2_tiny's output)
    assert quarantined["bad_cut_short"]["check"] == "video.truncated"
