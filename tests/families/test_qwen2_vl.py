"""qwen2_vl (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) against the reference's worked examples and HF's own code."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration,
                          Qwen2VLImageProcessor, Qwen3VLConfig, Qwen3VLForConditionalGeneration)

from photos import photo_of_size

from batchvlm.families import ModelConfig
from batchvlm.families import load_family
from batchvlm.families.qwen2_vl import QwenProcessorParams, mrope_positions, qwen_plan
from batchvlm.records import ImagePlan
from batchvlm.pipeline.tokens import build_layout
from batchvlm.format.schema import IMAGE

QWEN3 = QwenProcessorParams(patch_size=16, min_pixels=65536, max_pixels=16777216, image_mean=(0.5,) * 3,
                            image_std=(0.5,) * 3)


@pytest.fixture(scope="module")
def qwen():
    return load_family(ModelConfig(family="qwen2_vl"))


@pytest.mark.parametrize("params,width,height,resized,grid", [
    (QwenProcessorParams(), 1920, 1080, (728, 1316), (1, 52, 94)),
    (QWEN3, 1920, 1080, (1088, 1920), (1, 68, 120)),
    (QwenProcessorParams(), 42 * 10, 42, (56, 420), (1, 4, 30)),  # 42/28 = 1.5 rounds half to even: 2
    (QwenProcessorParams(), 70 * 6, 70, (56, 420), (1, 4, 30)),  # 70/28 = 2.5 rounds half to even: 2
])
def test_smart_resize_matches_the_worked_examples(params, width, height, resized, grid):
    plan = qwen_plan(height, width, params)
    assert plan.resized == resized and plan.grid_thw == grid
    assert plan.num_tokens == grid[1] * grid[2] // 4


def test_qwen3_parameters_plan_like_its_processor():
    processor = Qwen2VLImageProcessor(patch_size=16, merge_size=2, size={"shortest_edge": QWEN3.min_pixels,
                                      "longest_edge": QWEN3.max_pixels}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    for height, width in [(1080, 1920), (30, 4000), (64, 64), (1, 1), (5000, 4000)]:
        pixels = torch.from_numpy(photo_of_size(height, width)).permute(2, 0, 1)
        grid = processor(images=[pixels], return_tensors="pt")["image_grid_thw"][0]
        assert qwen_plan(height, width, QWEN3).grid_thw == tuple(grid.tolist()), (height, width)


def test_mrope_positions_match_the_reference_example():
    plan = ImagePlan(original=(4, 6), resized=(56, 84), padded=(56, 84), grid_thw=(1, 4, 6), num_tokens=6)
    positions, delta = mrope_positions(10, [(3, 6)], [plan], merge_size=2)
    assert positions[:, :3].tolist() == [[0, 1, 2]] * 3
    assert positions[0, 3:9].tolist() == [3] * 6
    assert positions[1, 3:9].tolist() == [3, 3, 3, 4, 4, 4]
    assert positions[2, 3:9].tolist() == [3, 4, 5, 3, 4, 5]
    assert positions[:, 9].tolist() == [6, 6, 6]
    assert delta == -3


def test_mrope_positions_equal_hf_get_rope_index_for_multi_image_records(qwen):
    model = Qwen2VLForConditionalGeneration.from_pretrained(qwen.checkpoint).eval()
    sizes = [(100, 150), (56, 56), (300, 90)]
    plans = [qwen.plan(h, w) for h, w in sizes]
    for text in ["<image> one", "a <image> b <image> c <image>", "<image><image><image>"]:
        count = text.count("<image>")
        layout = build_layout(text, "<image>", plans[:count], qwen)
        positions, delta = qwen.positions(layout, plans[:count])
        ids = torch.tensor([layout.input_ids])
        types = torch.tensor([[1 if tag == IMAGE else 0 for tag in layout.token_tags]])
        grids = torch.tensor([plan.grid_thw for plan in plans[:count]])
        expected, expected_delta = model.model.get_rope_index(ids, types, image_grid_thw=grids)
        assert positions.tolist() == expected[:, 0].tolist(), text
        assert delta == int(expected_delta), text


def _tiny_variant(folder, qwen, config) -> None:
    """A Qwen2.5-VL or Qwen3-VL checkpoint sharing the demo tokenizer, saved and read back like a real one."""
    model = {"qwen2_5_vl": Qwen2_5_VLForConditionalGeneration, "qwen3_vl": Qwen3VLForConditionalGeneration}[
        config.model_type]
    torch.manual_seed(0)
    model(config).eval().save_pretrained(folder)
    qwen.tokenizer.save_pretrained(folder)
    patch = config.vision_config.patch_size
    processor = json.loads((qwen.checkpoint / "preprocessor_config.json").read_text())
    processor.update(patch_size=patch, size={"shortest_edge": 64 * 64, "longest_edge": 32 * 32 * 256})
    (folder / "preprocessor_config.json").write_text(json.dumps(processor))


def _token_ids(qwen) -> dict:
    convert = qwen.tokenizer.convert_tokens_to_ids
    return dict(image_token_id=qwen.image_token_id, video_token_id=convert("<|video_pad|>"),
                vision_start_token_id=convert("<|vision_start|>"), vision_end_token_id=convert("<|vision_end|>"))


TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)


def qwen2_5_config(qwen):
    return Qwen2_5_VLConfig(
        text_config=dict(TEXT, vocab_size=len(qwen.tokenizer),
                         rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           window_size=56, fullatt_block_indexes=[1], patch_size=14), **_token_ids(qwen))


def qwen3_config(qwen):
    return Qwen3VLConfig(
        text_config=dict(TEXT, vocab_size=len(qwen.tokenizer), head_dim=16,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=16, num_position_embeddings=64, deepstack_visual_indexes=[0, 1]),
        **_token_ids(qwen))


@pytest.mark.parametrize("make_config", [None, qwen2_5_config, qwen3_config], ids=["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_tower_inputs_joined_per_image_equal_transformers_on_the_whole_batch(tmp_path, qwen, make_config):
    """Positions, Qwen2.5-VL's window order and boundaries, Qwen3-VL's taps: built once per grid (towers.grids), bit for
    bit what transformers' functions give for the whole packed batch."""
    from transformers.vision_utils import (get_vision_cu_seqlens, get_vision_interpolation_indices_and_weights,
                                           get_vision_position_ids, get_vision_window_index)

    if make_config is not None:
        _tiny_variant(tmp_path, qwen, make_config(qwen))
    family = qwen if make_config is None else load_family(ModelConfig(family="qwen2_vl", path=str(tmp_path)))
    encoder = family.load_encoder(torch.device("cpu"), torch.float32)
    tower = encoder.tower
    grid_thw = torch.tensor([(1, 8, 12), (1, 2, 2), (1, 20, 14), (1, 8, 12), (2, 4, 6)])
    expected = {"position_ids": get_vision_position_ids(grid_thw, tower.spatial_merge_size),
                "cu_seqlens": get_vision_cu_seqlens(grid_thw)}
    if family.version == "qwen2_5_vl":
        expected["window_index"], expected["cu_window_seqlens"] = get_vision_window_index(
            grid_thw, tower.spatial_merge_size, tower.window_size, tower.patch_size)
    if family.version == "qwen3_vl":
        expected["interp_indices"], expected["interp_weights"] = get_vision_interpolation_indices_and_weights(
            grid_thw, tower.num_grid_per_side, mode=tower.interpolation_mode,
            align_corners=tower.interpolation_align_corners, spatial_merge_size=tower.config.spatial_merge_size)
    for _ in range(2):  # computed, then every grid kept
        _, kwargs = encoder.inputs(torch.zeros(int(grid_thw.prod(-1).sum()), 1), grid_thw)
        assert {name: kwargs[name] for name in expected}.keys() == expected.keys()
        for name, value in expected.items():
            assert torch.equal(kwargs[name], value), name
