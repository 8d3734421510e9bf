"""Serving requests from the stored rows of real runs: vLLM's and sglang's splits give back each image's and clip's
rows."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import embed_in_process
from test_training_equivalence import CHECKPOINTS
from transformers import AutoConfig

from batchvlm.families import ModelConfig, load_family
from batchvlm.training.reader import read_run
from batchvlm.training.serving import SGLANG, VLLM, request, served_run, serving_requests

# runs of the job and checkpoints built for the engines' rules
pytestmark = pytest.mark.slow


def qwen2_5_checkpoint(folder):
    from test_qwen2_vl import _tiny_variant, qwen2_5_config  # tests/families, on the path of test_training_equivalence

    qwen = load_family(ModelConfig(family="qwen2_vl"))
    _tiny_variant(folder, qwen, qwen2_5_config(qwen))
    return folder


SERVED = {"qwen2_vl": CHECKPOINTS["qwen2_vl"], "qwen2_5_vl": qwen2_5_checkpoint, "qwen3_vl": CHECKPOINTS["qwen3_vl"],
          "kimi_k25": CHECKPOINTS["kimi_k25"]}
"""The checkpoints whose runs the engines serve: Qwen2-VL, Qwen2.5-VL and Qwen3-VL (the qwen2_vl family), Kimi-K2.5."""


@pytest.fixture(scope="module", params=list(SERVED))
def stored(request, tmp_path_factory):
    """A checkpoint (Qwen3-VL: with deepstack), its config, and the records of the job's run through it with the
    stored dtype users run (bf16)."""
    root = tmp_path_factory.mktemp(request.param)
    checkpoint = SERVED[request.param](root / "checkpoint")
    family = "kimi_k25" if request.param == "kimi_k25" else "qwen2_vl"
    run = embed_in_process(root, "serve", f"model.family={family}", f"model.path={checkpoint}", "dataset.limit=8")
    records = [record for record in read_run(run) if len(record.grid_thw)]
    assert any(len(record.grid_thw) > 1 for record in records)  # a record of several images is split too
    return request.param, AutoConfig.from_pretrained(checkpoint), run, records


def stored_rows(record) -> list[dict[str, torch.Tensor]]:
    """Each image's stored rows, by its span: image_embeds and (Qwen3-VL) each deepstack level's."""
    offsets = (record.image_spans[:, 1].cumsum(0) - record.image_spans[:, 1]).tolist()
    deepstack = record.extras.get("deepstack_embeds")
    hidden = record.image_embeds.shape[1]
    images = []
    for offset, length in zip(offsets, record.image_spans[:, 1].tolist()):
        image = {"main": record.image_embeds[offset:offset + length]}
        if deepstack is not None:
            for level in range(deepstack.shape[1] // hidden):
                image[f"level{level}"] = deepstack[offset:offset + length, level * hidden:(level + 1) * hidden]
        images.append(image)
    return images


def vllm_split(image_input: dict, config) -> list[dict[str, torch.Tensor]]:
    """vLLM: rows per image prod(grid) // merge**2; Qwen3-VL: [visual_dim | visual_dim * levels] on the last dim,
    the levels viewed as [n, levels, visual_dim]."""
    merge = config.vision_config.spatial_merge_size
    sizes = (image_input["image_grid_thw"].prod(-1) // merge // merge).tolist()
    levels = len(getattr(config.vision_config, "deepstack_visual_indexes", None) or [])
    visual_dim = getattr(config.vision_config, "out_hidden_size", None)
    images = []
    for rows in image_input["image_embeds"].split(sizes):
        if not levels:
            images.append({"main": rows})
            continue
        main, multiscale = rows.split([visual_dim, visual_dim * levels], dim=-1)
        per_level = multiscale.reshape(len(rows), levels, visual_dim).permute(1, 0, 2)
        images.append({"main": main, **{f"level{k}": per_level[k] for k in range(levels)}})
    return images


def sglang_split(item: dict, input_ids: list[int], config) -> tuple[list[dict], list[int]]:
    """sglang: an image is a run of image tokens in input_ids (get_mm_items_offset); its rows follow in order;
    Qwen3-VL's feature is [hidden | deepstack] at the language model's hidden size. Also each image's token count by
    the engine's own grid rule (prod(grid) // merge**2)."""
    token = config.image_token_id
    ids = torch.tensor(input_ids)
    mask = ids == token
    starts = (mask & ~torch.roll(mask, 1)).nonzero().flatten()
    ends = (mask & ~torch.roll(mask, -1)).nonzero().flatten()
    lengths = (ends - starts + 1).tolist()
    merge = config.vision_config.spatial_merge_size
    by_grid = (item["image_grid_thw"].prod(-1) // merge // merge).tolist()
    hidden = config.get_text_config().hidden_size
    images = []
    for rows in item["feature"].split(lengths):
        image = {"main": rows[:, :hidden]}
        deepstack = rows[:, hidden:]
        for level in range(deepstack.shape[1] // hidden):
            image[f"level{level}"] = deepstack[:, level * hidden:(level + 1) * hidden]
        images.append(image)
    return images, by_grid


def assert_same_rows(got: list[dict], expected: list[dict], record_id: str) -> None:
    assert len(got) == len(expected), record_id
    for image, (ours, stored) in enumerate(zip(got, expected)):
        assert ours.keys() == stored.keys(), (record_id, image)
        for name in stored:
            assert ours[name].dtype == stored[name].dtype and ours[name].shape == stored[name].shape
            assert torch.equal(ours[name].view(torch.uint8), stored[name].view(torch.uint8)), (record_id, image, name)


def test_vllms_split_of_the_request_gives_back_each_images_stored_rows_and_its_prompt(stored):
    name, config, run, records = stored
    if name == "kimi_k25":
        with pytest.raises(ValueError, match="pixel_values and grid_thws only"):
            served_run(run, VLLM)
        return
    served = served_run(run, VLLM)
    levels = len(getattr(config.vision_config, "deepstack_visual_indexes", None) or [])
    assert (levels > 0) == (name == "qwen3_vl")
    for record in records:
        prompt = request(record, served)
        image = prompt["multi_modal_data"]["image"]
        assert {"image_embeds", "image_grid_thw"} <= image.keys()  # DictEmbeddingItems' required fields
        embeds, grid = image["image_embeds"], image["image_grid_thw"]
        assert embeds.dtype == torch.bfloat16 == record.image_embeds.dtype and grid.dtype == torch.int64
        assert embeds.ndim == 2 and grid.shape == (len(record.grid_thw), 3)  # TensorShape("nf", "hs"), ("ni", 3)
        assert embeds.shape[1] == config.get_text_config().hidden_size * (1 + levels)
        assert_same_rows(vllm_split(image, config), stored_rows(record), record.id)
        assert expanded_by_vllm(prompt["prompt_token_ids"], grid, config) == record.input_ids.tolist()


def expanded_by_vllm(prompt: list[int], grid: torch.Tensor, config) -> list[int]:
    """vLLM's prompt update: the i-th image placeholder token becomes prod(grid_i) // merge**2 of it."""
    merge, token = config.vision_config.spatial_merge_size, config.image_token_id
    assert prompt.count(token) == len(grid)
    counts = iter((grid.prod(-1) // merge // merge).tolist())
    return [t for token_id in prompt for t in ([token_id] * next(counts) if token_id == token else [token_id])]


def test_sglangs_split_of_the_precomputed_item_gives_back_each_images_stored_rows(stored):
    name, config, run, records = stored
    if name == "kimi_k25":
        with pytest.raises(ValueError, match="process_kimi_token_ids_mm_data"):
            served_run(run, SGLANG)
        return
    served = served_run(run, SGLANG)
    for record in records:
        prompt = request(record, served)
        assert prompt["input_ids"] == record.input_ids.tolist()
        (item,) = prompt["image_data"]
        assert item["format"] == "precomputed_embedding" and "feature" in item  # the keys sglang pops
        assert item["feature"].dtype == torch.bfloat16 and item["image_grid_thw"].dtype == torch.int64
        assert item["image_grid_thw"].shape == (len(record.grid_thw), 3)
        images, by_grid = sglang_split(item, prompt["input_ids"], config)
        assert [len(image["main"]) for image in images] == by_grid
        assert_same_rows(images, stored_rows(record), record.id)


def test_every_record_of_a_run_gets_a_request_and_a_wrong_merge_size_is_refused(qwen_run, records):
    requests = list(serving_requests(qwen_run, VLLM))
    assert [record_id for record_id, _ in requests] == [record.id for record in records]
    for (_, prompt), record in zip(requests, records):
        assert ("multi_modal_data" in prompt) == (len(record.grid_thw) > 0)
    with pytest.raises(ValueError, match="merge_size=1 is not its checkpoint's"):
        list(serving_requests(qwen_run, SGLANG, merge_size=1))


def test_rows_no_engine_takes_are_refused_naming_why(siglip_run, tmp_path):
    for engine in (VLLM, SGLANG):
        with pytest.raises(ValueError, match="'siglip2'.*patch tokens before a projector"):
            served_run(siglip_run, engine)
    tower = embed_in_process(tmp_path, "tower", "model=qwen2_vl_tiny", "model.embedding=tower", "dataset.limit=2")
    with pytest.raises(ValueError, match="model.embedding=tower"):
        served_run(tower, VLLM)


def clip_rows(record) -> list[torch.Tensor]:
    """Each clip's stored rows of video_embeds, by its span."""
    lengths = record.video_spans[:, 1]
    return [record.video_embeds[offset:offset + length]
            for offset, length in zip((lengths.cumsum(0) - lengths).tolist(), lengths.tolist())]


def vllm_video_split(video: dict, config) -> list[torch.Tensor]:
    """vLLM's field factory for video: video_embeds flat_from_sizes by video_grid_thw.prod(-1) // merge // merge."""
    merge = config.vision_config.spatial_merge_size
    return list(video["video_embeds"].split((video["video_grid_thw"].prod(-1) // merge // merge).tolist()))


def expanded_by_vllm_per_item(prompt: list[int], items: dict[int, torch.Tensor], config) -> list[int]:
    """vLLM's prompt update for each modality: the i-th placeholder token of a modality (image_token_id,
    video_token_id) becomes prod(grid_i) // merge**2 of it."""
    merge = config.vision_config.spatial_merge_size
    counts = {token: iter((grid.prod(-1) // merge // merge).tolist()) for token, grid in items.items()}
    for token, grid in items.items():
        assert prompt.count(token) == len(grid)
    return [t for token_id in prompt
            for t in ([token_id] * next(counts[token_id]) if token_id in counts else [token_id])]


def test_vllms_video_split_gives_back_each_clips_stored_rows_and_its_prompt(clip_run):
    """The clip run (Qwen2-VL, bf16): vLLM's split of video_embeds by video_grid_thw gives back each clip's stored
    rows bit for bit, its prompt (one <|video_pad|> per clip, in vision_start/end) expands to the stored input_ids,
    and the fields have the names, dtypes and shapes of Qwen2VLVideoEmbeddingInputs."""
    from batchvlm.families import tiny_checkpoint

    config = AutoConfig.from_pretrained(tiny_checkpoint("qwen2_vl"))
    served = served_run(clip_run, VLLM)
    clips = [record for record in read_run(clip_run) if record.video_embeds is not None]
    assert {record.id for record in clips} == {"astronaut_pan", "coffee_zoom_and_cat", "moon_and_astronaut"}
    for record in clips:
        prompt = request(record, served)
        video = prompt["multi_modal_data"]["video"]
        assert {"video_embeds", "video_grid_thw"} <= video.keys()
        embeds, grid = video["video_embeds"], video["video_grid_thw"]
        assert embeds.dtype == torch.bfloat16 == record.video_embeds.dtype and grid.dtype == torch.int64
        assert embeds.ndim == 2 and embeds.shape[1] == config.get_text_config().hidden_size  # ("nf", "hs")
        assert grid.shape == (len(record.video_spans), 3)  # ("nv", 3)
        assert video["second_per_grid_ts"].shape == (len(grid),) and video["second_per_grid_ts"].is_floating_point()
        assert (video["second_per_grid_ts"] > 0).all()
        ours = vllm_video_split(video, config)
        assert len(ours) == len(record.video_spans)
        for got, stored in zip(ours, clip_rows(record)):
            assert torch.equal(got.view(torch.uint8), stored.view(torch.uint8)), record.id
        ids = prompt["prompt_token_ids"]
        for token in (config.video_token_id, config.image_token_id):  # each placeholder wrapped in vision_start/end
            at = [i for i, t in enumerate(ids) if t == token]
            assert all(ids[i - 1] == config.vision_start_token_id and ids[i + 1] == config.vision_end_token_id
                       for i in at)
        items = {config.video_token_id: grid}
        if "image" in prompt["multi_modal_data"]:
            items[config.image_token_id] = prompt["multi_modal_data"]["image"]["image_grid_thw"]
        assert expanded_by_vllm_per_item(ids, items, config) == record.input_ids.tolist()
    assert any("image" in request(record, served)["multi_modal_data"] for record in clips)  # a clip and an image


def test_sglang_refuses_a_record_with_clips_by_id_and_a_clip_without_its_grid_is_refused(clip_run):
    """sglang's precomputed video item is not built: each record with clips is refused by id, naming what it lacks.
    A record whose run stores no grids for its clips (a format-2 run upgraded) has no vLLM request either."""
    clips = [record for record in read_run(clip_run) if record.video_embeds is not None]
    served = served_run(clip_run, SGLANG)
    for record in clips:
        with pytest.raises(ValueError, match=rf"record {record.id!r} holds {len(record.video_spans)} clip.*"
                                             r"video_embeds.*video_grid_thw.*second_per_grid_ts"):
            request(record, served)
    with pytest.raises(ValueError, match="record 'astronaut_pan' holds 1 clip"):
        list(serving_requests(clip_run, SGLANG))
    ungridded = dataclasses.replace(clips[0], video_grid_thw=None, second_per_grid_ts=None)
    with pytest.raises(ValueError, match=rf"record {clips[0].id!r} holds .* no video_grid_thw"):
        request(ungridded, served_run(clip_run, VLLM))
