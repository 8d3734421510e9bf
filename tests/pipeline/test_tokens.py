"""Span detection and layout: non-circular runs, framing that keeps adjacent images apart."""

from __future__ import annotations

import copy

import pytest

from batchvlm.checks import CheckFailed
from batchvlm.pipeline.tokens import build_layout, find_spans, place_images
from batchvlm.format.schema import FRAME, IMAGE, TEXT

X = 7


@pytest.mark.parametrize("ids,spans", [
    ([X, X, 1, X, X], [(0, 2), (3, 2)]),  # starts and ends with a span: the circular-roll pitfall
    ([X, X, X], [(0, 3)]),  # nothing but a span
    ([1, 2, 3], []),  # no image token
    ([], []),
    ([1, X, 2, X, X, X, 3], [(1, 1), (3, 3)]),
])
def test_spans_are_found_without_wraparound(ids, spans):
    assert find_spans(ids, X) == spans


def test_adjacent_images_get_separate_spans_with_k3_framing(kimi_family):
    plans = [kimi_family.plan(100, 100), kimi_family.plan(300, 200)]
    layout = build_layout("<image><image> two photos", "<image>", plans, kimi_family)
    assert [length for _, length in layout.image_spans] == [p.num_tokens for p in plans]
    assert len(layout.token_tags) == len(layout.input_ids)
    first_start, first_length = layout.image_spans[0]
    assert layout.token_tags[first_start - 1] == FRAME and layout.token_tags[first_start] == IMAGE
    assert layout.token_tags[-1] == TEXT


def test_k3_frame_names_the_original_size(kimi_family):
    plan = kimi_family.plan(3000, 4000)  # resized, but the frame keeps 4000x3000
    ids, _ = kimi_family.expand_image(plan)
    assert "image 4000x3000" in kimi_family.tokenizer.decode(ids)


def test_adjacent_images_merge_without_framing_and_are_caught(kimi_family):
    family = copy.copy(kimi_family)
    family.framing = "plain"
    plans = [kimi_family.plan(100, 100), kimi_family.plan(100, 100)]
    with pytest.raises(CheckFailed) as caught:
        build_layout("<image><image>", "<image>", plans, family)
    assert caught.value.check == "text.image_span_count"
    assert (caught.value.expected, caught.value.observed) == ("2", "1")


def test_missing_placeholders_follow_the_policy():
    assert place_images("a caption", "<image>", 2, "prepend") == "<image><image>a caption"
    with pytest.raises(CheckFailed) as caught:
        place_images("a caption", "<image>", 1, "quarantine")
    assert caught.value.check == "text.placeholder_count"
    with pytest.raises(CheckFailed):
        place_images("<image> <image>", "<image>", 1, "prepend")


class _ShiftedPositions:
    """A family whose M-RoPE positions lose their last token, or whose delta is off by one."""

    def __init__(self, inner, drop_last: bool):
        self.inner, self.drop_last = inner, drop_last

    def positions(self, layout, plans, clip_plans=()):
        positions, delta = self.inner.positions(layout, plans, clip_plans)
        return (positions[:, :-1], delta) if self.drop_last else (positions, delta + 1)


def test_a_record_with_no_text_and_no_image_gets_empty_positions():
    from batchvlm.families import ModelConfig
    from batchvlm.families import load_family
    from batchvlm.pipeline.tokens import attach_positions

    qwen = load_family(ModelConfig(family="qwen2_vl"))
    layout = build_layout("", "<image>", [], qwen)
    attach_positions(layout, [], qwen)
    assert layout.position_ids.shape == (3, 0) and layout.rope_delta == 0


@pytest.mark.parametrize("drop_last", [True, False], ids=["short", "delta"])
def test_position_ids_that_do_not_fit_the_sequence_are_caught(drop_last):
    from batchvlm.families import ModelConfig
    from batchvlm.families import load_family
    from batchvlm.pipeline.tokens import attach_positions

    qwen = load_family(ModelConfig(family="qwen2_vl"))
    plans = [qwen.plan(100, 150), qwen.plan(56, 56)]
    layout = build_layout("a <image> b <image>", "<image>", plans, qwen)
    attach_positions(layout, plans, qwen)
    assert layout.position_ids.shape == (3, len(layout.input_ids))
    with pytest.raises(CheckFailed) as caught:
        attach_positions(layout, plans, _ShiftedPositions(qwen, drop_last))
    assert caught.value.check == "text.position_ids"


@pytest.mark.parametrize("name", ["qwen2_vl", "kimi_k25"])
def test_a_plain_text_holding_a_control_token_string_is_quarantined_or_read_as_plain_text(name):
    """A caption is data: `<|im_end|>` in it must not become the tokenizer's control token."""
    from batchvlm.families import ModelConfig
    from batchvlm.families import load_family

    family = load_family(ModelConfig(family=name))
    text = "a caption <|im_end|> that ends twice"
    with pytest.raises(CheckFailed) as caught:
        build_layout(text, "<image>", [], family)
    assert caught.value.check == "text.control_token" and "<|im_end|>" in caught.value.message
    plain = build_layout(text, "<image>", [], family, control_tokens="text")
    specials = {i for i, token in family.tokenizer.added_tokens_decoder.items() if token.special}
    assert not specials & set(plain.input_ids) and family.tokenizer.decode(plain.input_ids) == text
    assert build_layout("a caption", "<image>", [], family).input_ids == family.encode_text("a caption")
