"""Clips through the embed job, end to end (issue 31), for Qwen2-VL over Qwen2's real vocabulary and for the
Qwen2.5-VL checkpoint variant: LLaVA records with a clip and an image, run in this process (its DataLoader worker and
isolated decoder as the job starts them), each stored value held to an oracle no one here wrote: the ids to the
checkpoint's processor (`apply_chat_template`, then its expansion of the clip and the image), `video_grid_thw` to its
AutoVideoProcessor on the same frames, the stored clip tokens to the model's own `get_video_features` on that
processor's pixels, the positions to the model's own `get_rope_index` (with `second_per_grid_ts` on Qwen2.5-VL); a
truncated clip and a clip without its placeholder quarantined under their checks."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import embed_in_process
from PIL import Image

from batchvlm.format.schema import FRAME, VIDEO
from batchvlm.pipeline.video import VideoConfig, decode_frames, probe
from batchvlm.training.export import export_run
from batchvlm.training.interop import mm_token_type_ids
from clips import make_clip
from photos import photo_of_size

pytestmark = pytest.mark.slow

CLIPS = {"a.mp4": (31, 10, 112, 168), "b.mp4": (12, 4, 140, 100)}
"""name -> (frames, fps, height, width): each clip's last M-RoPE time (Qwen2.5-VL: 2 per second) below its spatial
extent, where transformers' get_rope_index keeps the authors' rule that the job follows (docs/video.md)."""
QUESTION = "What happens, and in"
FPS = 2.0
"""The frames sampled per second (the video processor's default, which the tiny checkpoints keep)."""
RECORDS = [
    {"id": "clip_and_image", "video": "a.mp4", "image": "photo.png",
     "conversations": [{"from": "human", "value": f"<video>\n{QUESTION} <image>?"},
                       {"from": "gpt", "value": "A ball rolls past a wall."}]},
    {"id": "two_clips", "video": ["b.mp4", "a.mp4"], "image": [],
     "conversations": [{"from": "human", "value": "<video> then <video>: which is longer?"},
                       {"from": "gpt", "value": "The second."}]},
    {"id": "truncated", "video": "cut.webm", "image": [],
     "conversations": [{"from": "human", "value": "<video>What is it?"}, {"from": "gpt", "value": "Cut short."}]},
    {"id": "unplaced", "video": "a.mp4", "image": [],
     "conversations": [{"from": "human", "value": "What is it?"}, {"from": "gpt", "value": "No place for it."}]},
]


def write_dataset(folder: Path, clips: dict = CLIPS) -> Path:
    """RECORDS as a LLaVA JSON over `clips` (name: frames, fps, height, width), a cut WebM and a photo."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, (frames, fps, height, width) in clips.items():
        (folder / name).write_bytes(make_clip(frames, fps=fps, height=height, width=width))
    whole = make_clip(60, codec="libvpx", container="webm")  # Matroska states its duration: the cut is seen
    (folder / "cut.webm").write_bytes(whole[:len(whole) * 2 // 3])
    Image.fromarray(photo_of_size(70, 120)).save(folder / "photo.png")
    (folder / "llava.json").write_text(json.dumps(RECORDS))
    return folder / "llava.json"


def qwen2_5_checkpoint(folder: Path) -> Path:
    """The Qwen2.5-VL variant (window attention in the tower, tokens_per_second 2 as the 7B release states it, not
    transformers' default 4) over the demo tokenizer, saved as transformers saves it, with the demo's image processor."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from batchvlm.families import ModelConfig, load_family

    qwen = load_family(ModelConfig(family="qwen2_vl"))
    convert = qwen.tokenizer.convert_tokens_to_ids
    config = Qwen2_5_VLConfig(
        text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(qwen.tokenizer),
                         rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           window_size=56, fullatt_block_indexes=[1], patch_size=14, tokens_per_second=2),
        image_token_id=qwen.image_token_id, video_token_id=convert("<|video_pad|>"),
        vision_start_token_id=convert("<|vision_start|>"), vision_end_token_id=convert("<|vision_end|>"))
    torch.manual_seed(0)
    Qwen2_5_VLForConditionalGeneration(config).eval().save_pretrained(folder)
    qwen.tokenizer.save_pretrained(folder)
    shutil.copy(qwen.checkpoint / "preprocessor_config.json", folder)
    return folder


RUNS = {
    # Qwen2-VL in fp32, its images by the HF image processor (every one also through the parity check), its clips by
    # frame_rows as under every backend
    "qwen2_vl": ("float32", ["preprocess.backend=reference", "preprocess.parity_sample_rate=1.0"]),
    # Qwen2.5-VL as users run it: bf16 tower and output, the torch backend
    "qwen2_5_vl": ("bfloat16", ["preprocess.backend=torch", "model.dtype=bfloat16"]),
}
TOLERANCE = {"float32": 1e-3, "bfloat16": 3e-2}
"""Largest difference from the fp32 model's own output, relative to its largest value: fp32, or bf16's 8 bits."""


@pytest.fixture(scope="module", params=list(RUNS))
def video_run(request, tmp_path_factory, qwen_real_checkpoint):
    checkpoint = qwen_real_checkpoint if request.param == "qwen2_vl" else qwen2_5_checkpoint(
        tmp_path_factory.mktemp("qwen2_5_vl"))
    dataset = write_dataset(tmp_path_factory.mktemp("clips"))
    root = tmp_path_factory.mktemp("outputs")
    dtype, overrides = RUNS[request.param]
    run = embed_in_process(root, "clips", "dataset=llava", f"dataset.path={dataset}", "model=qwen2_vl_tiny",
                           f"model.path={checkpoint}", f"output.embed_dtype={dtype}", *overrides,
                           "checks.max_quarantine_fraction=0.9")
    return request.param, checkpoint, dataset.parent, run


def rows_of(run: Path, kind: str) -> dict[str, dict]:
    import pyarrow.parquet as pq

    return {row["id"]: row for path in sorted((run / kind).rglob("*.parquet"))
            for row in pq.read_table(path).to_pylist()}


def every_frame(path: Path) -> np.ndarray:
    data = path.read_bytes()
    header = probe(data, VideoConfig())
    return decode_frames(data, header, list(range(header.frames)), VideoConfig()).frames


@functools.cache
def reference_processor(version: str, checkpoint: Path):
    """The checkpoint's own processor (its tokenizer, image and video processors, chat template), loaded once."""
    from transformers import (AutoImageProcessor, AutoTokenizer, AutoVideoProcessor, Qwen2_5_VLProcessor,
                              Qwen2VLProcessor, Qwen3VLProcessor)

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    kind = {"qwen2_vl": Qwen2VLProcessor, "qwen2_5_vl": Qwen2_5_VLProcessor, "qwen3_vl": Qwen3VLProcessor}[version]
    return kind(image_processor=AutoImageProcessor.from_pretrained(checkpoint),
                video_processor=AutoVideoProcessor.from_pretrained(checkpoint), tokenizer=tokenizer,
                chat_template=tokenizer.chat_template)


def reference_inputs(version: str, checkpoint: Path, folder: Path, record: dict, **videos_kwargs) -> dict:
    """The checkpoint's own processor on the record: its chat template over the turns as messages (a clip and an
    image as {type: video} and {type: image} blocks), then its expansion with every frame of each clip (sampled by
    the video processor itself, do_sample_frames) and the image."""
    from transformers.video_utils import VideoMetadata

    processor = reference_processor(version, checkpoint)
    messages = [{"role": {"human": "user", "gpt": "assistant"}[turn["from"]], "content": blocks(turn["value"])}
                for turn in record["conversations"]]
    rendered = processor.apply_chat_template(messages, tokenize=False)
    videos = [record["video"]] if isinstance(record["video"], str) else record["video"]
    images = [record["image"]] if isinstance(record["image"], str) else record["image"]
    metadata = [VideoMetadata(total_num_frames=CLIPS[name][0], fps=CLIPS[name][1], height=CLIPS[name][2],
                              width=CLIPS[name][3], duration=CLIPS[name][0] / CLIPS[name][1]) for name in videos]
    return processor(text=[rendered], images=[np.asarray(Image.open(folder / name)) for name in images] or None,
                     videos=[torch.from_numpy(every_frame(folder / name)).permute(0, 3, 1, 2) for name in videos],
                     videos_kwargs={"video_metadata": metadata, "do_sample_frames": True,
                                    "cap_pixels_per_frame": True, **videos_kwargs}, return_tensors="pt")


def blocks(text: str) -> list[dict]:
    """A LLaVA turn's text as content blocks, `<video>` and `<image>` where they stand."""
    parts = []
    for piece in text.replace("<video>", "\0video\0").replace("<image>", "\0image\0").split("\0"):
        if piece in ("video", "image"):
            parts.append({"type": piece})
        elif piece:
            parts.append({"type": "text", "text": piece})
    return parts


def model_of(version: str, checkpoint: Path):
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration

    return {"qwen2_vl": Qwen2VLForConditionalGeneration, "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration}[
        version].from_pretrained(checkpoint, dtype=torch.float32).eval()


def embeds(row: dict, column: str, hidden: int, dtype: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(row[column]), dtype=getattr(torch, dtype)).view(-1, hidden).float()


def test_a_clip_and_an_image_are_stored_as_the_checkpoints_processor_and_model_give_them(video_run):
    version, checkpoint, folder, run = video_run
    rows = rows_of(run, "data")
    assert set(rows) == {"clip_and_image", "two_clips"}
    model = model_of(version, checkpoint)
    for record in RECORDS[:2]:
        row, reference = rows[record["id"]], reference_inputs(version, checkpoint, folder, record, fps=FPS)
        assert row["input_ids"] == reference["input_ids"][0].tolist(), record["id"]
        assert row["video_grid_thw"] == reference["video_grid_thw"].tolist(), record["id"]
        if version == "qwen2_5_vl":
            assert row["second_per_grid_ts"] == pytest.approx(reference["second_per_grid_ts"].tolist(), rel=1e-6)
        with torch.inference_mode():
            theirs = torch.cat(model.model.get_video_features(reference["pixel_values_videos"],
                                                             reference["video_grid_thw"]).pooler_output)
            extra = {"second_per_grid_ts": reference["second_per_grid_ts"]} if version == "qwen2_5_vl" else {}
            types = mm_token_type_ids(torch.tensor([row["token_tags"]], dtype=torch.int8))  # 2 on clip tokens
            positions, delta = model.model.get_rope_index(
                reference["input_ids"], types, image_grid_thw=reference.get("image_grid_thw"),
                video_grid_thw=reference["video_grid_thw"], **extra)
        dtype = RUNS[version][0]
        ours = embeds(row, "video_embeds", theirs.shape[-1], dtype)
        assert ours.shape == theirs.shape and sum(row["video_num_tokens"]) == len(ours)
        assert (ours - theirs).abs().max() <= TOLERANCE[dtype] * theirs.abs().max(), record["id"]
        assert row["position_ids"] == positions[:, 0].tolist() and row["rope_delta"] == int(delta), record["id"]
        tags = np.asarray(row["token_tags"])
        for span in row["video_spans"]:
            start, length = span["start"], span["length"]
            assert tags[start - 1:start + length + 1].tolist() == [FRAME] + [VIDEO] * length + [FRAME]
        assert not np.asarray(row["loss_mask"])[tags == VIDEO].any()
        # the sampled frames, as the family's rule picks them, and their times from the clips' pts
        videos = [record["video"]] if isinstance(record["video"], str) else record["video"]
        for indices, times, name in zip(row["video_frame_indices"], row["video_frame_times"], videos):
            assert len(indices) % 2 == 0 and times == pytest.approx([i / CLIPS[name][1] for i in indices])


def test_a_truncated_clip_and_a_clip_without_its_placeholder_are_quarantined_naming_the_clip(video_run):
    _, _, _, run = video_run
    quarantined = rows_of(run, "quarantine")
    assert {key: row["check"] for key, row in quarantined.items()} == {
        "truncated": "video.truncated", "unplaced": "text.placeholder_count"}
    assert quarantined["truncated"]["video_index"] == 0 and quarantined["truncated"]["image_index"] is None
    assert [Path(path).name for path in quarantined["truncated"]["video_paths"]] == ["cut.webm"]
    assert "1 video placeholder" in quarantined["unplaced"]["message"]


def test_the_parity_sample_checks_every_clip_against_the_video_processor_in_the_job(video_run):
    """parity_sample_rate=1.0 (the Qwen2-VL run): every image and every clip of a written row compared with the HF
    processors (Qwen2VLVideoProcessor for the clips) and none failed."""
    version, _, _, run = video_run
    if version != "qwen2_vl":
        pytest.skip("the Qwen2-VL run samples every image and clip")
    written = rows_of(run, "data")
    media = sum(len(row["grid_thw"] or []) + len(row["video_grid_thw"] or []) for row in written.values())
    assert json.loads((run / "_SUCCESS").read_text())["parity"] == {"checked_images": media, "failed_images": 0}


@pytest.mark.parametrize("fallback", ["cpu", "quarantine"])
def test_a_clips_wrong_backend_rows_are_redone_on_the_cpu_path_or_quarantine_naming_the_clip(
        video_run, tmp_path, monkeypatch, fallback):
    """BATCHVLM_FAULTS=preprocess.wrong_clip: the backend's rows of a record's clips one row short. fallback=cpu: each
    redone on the CPU path, the rows written as the clean run's, counted in _SUCCESS; quarantine: the record
    quarantined under preprocess.feature_length naming its first clip. The other records unchanged."""
    version, checkpoint, folder, clean = video_run
    if version != "qwen2_vl":
        pytest.skip("one family's run is enough")
    monkeypatch.setenv("BATCHVLM_FAULTS", "preprocess.wrong_clip=two_clips")
    run = embed_in_process(tmp_path, "clips", "dataset=llava", f"dataset.path={folder / 'llava.json'}",
                           "model=qwen2_vl_tiny", f"model.path={checkpoint}", "output.embed_dtype=float32",
                           *RUNS[version][1], f"preprocess.fallback={fallback}", "checks.max_quarantine_fraction=0.9")
    written, expected = rows_of(run, "data"), rows_of(clean, "data")
    success = json.loads((run / "_SUCCESS").read_text())
    if fallback == "cpu":
        assert set(written) == set(expected)
        assert written["two_clips"]["video_embeds"] == expected["two_clips"]["video_embeds"]
        assert success["fallbacks"] == {"preprocess.feature_length": 2}
        return
    assert set(written) == set(expected) - {"two_clips"}
    failure = rows_of(run, "quarantine")["two_clips"]
    assert (failure["check"], failure["video_index"], failure["image_index"]) == ("preprocess.feature_length", 0, None)
    assert written["clip_and_image"]["video_embeds"] == expected["clip_and_image"]["video_embeds"]


def test_a_stored_clip_row_trains_with_the_loss_the_model_gives_on_its_pixels(video_run):
    """training.model_inputs on the stored rows (the clips' tokens as `mm_encoder_outputs["video"]`, the stored
    positions), against the model's own forward on the processor's `pixel_values_videos` (its own positions), with
    the same labels."""
    from batchvlm.training.model_inputs import model_inputs
    from batchvlm.training.packing import pack
    from batchvlm.training.reader import read_run

    version, checkpoint, folder, run = video_run
    model = model_of(version, checkpoint)
    stored = {record.id: record for record in read_run(run)}
    for record in RECORDS[:2]:
        batch = pack([stored[record["id"]]], 4096)
        assert batch.video_embeds is not None and len(batch.video_embeds) == (batch.token_tags == VIDEO).sum()
        reference = reference_inputs(version, checkpoint, folder, record, fps=FPS)
        with torch.inference_mode():
            ours = model(**model_inputs(model, batch)).loss
            theirs = model(**{key: value for key, value in reference.items() if key != "attention_mask"},
                           labels=batch.labels, use_cache=False).loss
        within = 1e-4 if RUNS[version][0] == "float32" else 1e-2
        assert torch.isfinite(ours) and abs(float(ours) - float(theirs)) <= within * abs(float(theirs)), record["id"]


def test_the_estimate_sizes_clip_records_from_their_headers_alone(video_run, tmp_path):
    """batchvlm-estimate on the same records: each clip probed and sampled, none decoded; the grids it plans are the
    job's, its rows as wide as the job's (their clip tokens counted), the bad records quarantined as the job does (the
    cut clip by its packets, short of its stated duration)."""
    from batchvlm.families import ModelConfig
    from batchvlm.rundir.sink import OutputConfig
    from batchvlm.sizing.estimate import EstimateConfig, estimate
    from batchvlm.sources.config import dataset_config

    version, checkpoint, folder, run = video_run
    result = estimate(EstimateConfig(
        dataset=dataset_config(kind="json", format="llava", images_column="image", text_column="conversations",
                               path=str(folder / "llava.json")),
        model=ModelConfig(family="qwen2_vl", path=str(checkpoint)), output=OutputConfig(embed_dtype="float32"),
        records=len(RECORDS)))
    assert result.sampled == len(RECORDS) and result.quarantined == 2
    written = rows_of(run, "data")
    assert result.data_bytes_per_record > min(len(row["video_embeds"]) for row in written.values())


def test_the_demos_clips_embed_and_its_cut_clip_is_quarantined_with_its_check(tmp_path):
    """`dataset=demo_clips model=qwen2_vl_tiny`: camera moves over the demo's photographs (mp4 and WebM), one with a
    photo, one record with two clips; the clip cut short quarantined as video.truncated."""
    run = embed_in_process(tmp_path, "demo-clips", "dataset=demo_clips", "model=qwen2_vl_tiny")
    written, quarantined = rows_of(run, "data"), rows_of(run, "quarantine")
    assert set(written) == {"astronaut_pan", "coffee_zoom_and_cat", "moon_and_astronaut"}
    assert {key: row["check"] for key, row in quarantined.items()} == {"bad_cut_short": "video.truncated"}
    assert [len(written[key]["video_grid_thw"]) for key in sorted(written)] == [1, 1, 2]
    assert written["coffee_zoom_and_cat"]["grid_thw"] and written["moon_and_astronaut"]["video_embeds"]


def test_the_packed_loader_puts_each_clip_token_row_where_its_token_is(video_run):
    """PackedLoader over the run: both clip records in one pack, each clip token's stored row at its place."""
    from batchvlm.training.loader import LoaderConfig, PackedLoader

    version, _, _, run = video_run
    rows = rows_of(run, "data")
    (batch,) = list(PackedLoader(run, LoaderConfig(max_tokens=4096, shuffle_buffer=1, num_workers=0)))
    assert sorted(batch.ids) == sorted(rows)
    hidden, dtype = batch.image_embeds.shape[-1], RUNS[version][0]
    stored = torch.cat([embeds(rows[key], "video_embeds", hidden, dtype) for key in batch.ids])
    assert torch.equal(batch.video_embeds.float(), stored)
    tags = batch.token_tags[0]
    assert torch.equal(batch.video_positions, torch.nonzero(tags == VIDEO).flatten())


def test_messages_records_with_video_blocks_and_a_videos_column_store_what_their_llava_twins_do(video_run, tmp_path):
    """The same conversations as HF/TRL messages in Parquet (`{type: video}` blocks, clips in `videos`, the images
    in `images`, as LLaMA-Factory's sharegpt takes them): the same ids, grids, positions and clip tokens."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    version, checkpoint, folder, run = video_run
    dtype, overrides = RUNS[version]
    rows = []
    for record in RECORDS[:2]:
        messages = [{"role": {"human": "user", "gpt": "assistant"}[turn["from"]], "content": blocks(turn["value"])}
                    for turn in record["conversations"]]
        videos = [record["video"]] if isinstance(record["video"], str) else record["video"]
        images = [record["image"]] if isinstance(record["image"], str) else record["image"]
        rows.append({"id": record["id"], "messages": json.dumps(messages), "videos": videos, "images": images})
    pq.write_table(pa.Table.from_pylist(rows), folder / "messages.parquet")
    twins = embed_in_process(tmp_path, "messages", "dataset=messages", f"dataset.path={folder / 'messages.parquet'}",
                             "model=qwen2_vl_tiny", f"model.path={checkpoint}", f"output.embed_dtype={dtype}",
                             *overrides)
    ours, theirs = rows_of(twins, "data"), rows_of(run, "data")
    assert set(ours) == set(theirs) == {"clip_and_image", "two_clips"}
    for key in ours:
        for column in ("input_ids", "video_spans", "video_grid_thw", "position_ids", "video_frame_indices",
                       "video_embeds", "token_tags", "loss_mask"):
            assert ours[key][column] == theirs[key][column], (key, column)
    exported = export_run(twins, "swift", tmp_path / "export")  # a messages run's clip records: skipped as clips too
    assert exported.exported == 0 and exported.skipped == {"video": 2}


def test_odd_clip_files_are_each_quarantined_under_a_named_check_and_a_good_one_beside_them_is_written(tmp_path):
    """A hostile dataset's clips through the job (the demo checkpoint): a directory named .mp4, a 0-byte file, a PNG
    named .mp4 (FFmpeg reads it as a one-frame video), a missing file and a path out of the root; never a traceback."""
    import io

    from conftest import data_ids, quarantine_rows

    folder = tmp_path / "clips"
    folder.mkdir()
    (folder / "good.mp4").write_bytes(make_clip(12, fps=4))
    (folder / "dir.mp4").mkdir()
    (folder / "empty.mp4").write_bytes(b"")
    png = io.BytesIO()
    Image.fromarray(photo_of_size(40, 60)).save(png, format="PNG")
    (folder / "image.mp4").write_bytes(png.getvalue())
    names = ["good.mp4", "dir.mp4", "empty.mp4", "image.mp4", "missing.mp4", "../outside.mp4"]
    (folder / "llava.json").write_text(json.dumps([
        {"id": name, "video": name, "conversations": [{"from": "human", "value": "<video>What is it?"},
                                                      {"from": "gpt", "value": "A clip."}]} for name in names]))
    run = embed_in_process(tmp_path / "outputs", "odd", "dataset=llava", f"dataset.path={folder / 'llava.json'}",
                           "model=qwen2_vl_tiny", "checks.max_quarantine_fraction=0.9")
    assert data_ids(run) == {"good.mp4"}
    assert {row["id"]: row["check"] for row in quarantine_rows(run)} == {
        "dir.mp4": "decode.not_a_file", "empty.mp4": "video.unreadable", "image.mp4": "video.too_few_frames",
        "missing.mp4": "decode.missing_file", "../outside.mp4": "decode.path_outside_root"}


def test_vllms_video_request_from_stored_clips_carries_the_processors_grids_and_time_steps(video_run):
    """vLLM's request for each record with a clip and an image (serving, issue 30 item 7), on both versions: its
    `video_grid_thw` and (Qwen2.5-VL) `second_per_grid_ts` are the checkpoint's processor's; vLLM's rules read in
    its code (qwen2_vl.py @002d181a: rows per clip prod(grid) // merge**2, each placeholder of a modality expanded
    to that many of it) give back each clip's stored rows bit for bit and the stored input_ids."""
    from transformers import AutoConfig

    from batchvlm.training.reader import read_run
    from batchvlm.training.serving import VLLM, request, served_run

    version, checkpoint, folder, run = video_run
    config = AutoConfig.from_pretrained(checkpoint)
    merge = config.vision_config.spatial_merge_size
    served = served_run(run, VLLM)
    for record in read_run(run):
        reference = reference_inputs(version, checkpoint, folder, next(r for r in RECORDS if r["id"] == record.id),
                                     fps=FPS)
        media = request(record, served)["multi_modal_data"]
        video = media["video"]
        assert torch.equal(video["video_grid_thw"], reference["video_grid_thw"]), record.id
        if version == "qwen2_5_vl":
            assert video["second_per_grid_ts"].tolist() == pytest.approx(reference["second_per_grid_ts"].tolist())
        sizes = (video["video_grid_thw"].prod(-1) // merge // merge).tolist()
        lengths = record.video_spans[:, 1].tolist()
        offsets = np.cumsum([0] + lengths[:-1]).tolist()
        for rows, offset, length in zip(video["video_embeds"].split(sizes), offsets, lengths, strict=True):
            assert torch.equal(rows.view(torch.uint8),
                               record.video_embeds[offset:offset + length].view(torch.uint8)), record.id
        counts = {config.video_token_id: iter(sizes)}
        if "image" in media:
            counts[config.image_token_id] = iter((media["image"]["image_grid_thw"].prod(-1) // merge // merge).tolist())
        prompt = request(record, served)["prompt_token_ids"]
        expanded = [t for token in prompt for t in ([token] * next(counts[token]) if token in counts else [token])]
        assert expanded == reference["input_ids"][0].tolist() == record.input_ids.tolist(), record.id
        at = [i for i, token in enumerate(prompt) if token == config.video_token_id]  # one pad a clip, in its frame
        assert len(at) == len(lengths) and all(
            (prompt[i - 1], prompt[i + 1]) == (config.vision_start_token_id, config.vision_end_token_id) for i in at)
