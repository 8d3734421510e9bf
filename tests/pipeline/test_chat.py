"""Conversations rendered with the checkpoint's chat template, images expanded, the trained tokens marked.

The oracles run on Qwen2-VL's real vocabulary (tests/qwen_vocab.py): the ids equal transformers' Qwen2VLProcessor's,
the mask equals transformers' `assistant_masks` where transformers gets it right (text only) and the mask derived
from the turns' markers where it does not (with images); Kimi-K2.5 and Qwen3-VL render as their templates do.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from batchvlm.checks import CheckFailed
from batchvlm.families import ModelConfig
from batchvlm.pipeline.chat import TextConfig
from batchvlm.families import load_family
from batchvlm.format.schema import FRAME, IMAGE, TEXT
from batchvlm.pipeline.chat import ChatRenderer, check_roles
from batchvlm.pipeline.text import Conversation, PlainText, laid_out
from batchvlm.records import TokenLayout, Turn
from photos import demo_images

TEMPLATES = Path(__file__).resolve().parents[1] / "families" / "templates"

CAT_AND_DOG = [Turn("user", (None, "What is this?")), Turn("assistant", ("A cat.",)),
               Turn("user", ("And this?", None)), Turn("assistant", ("A dog.",))]
"""Two images in two user turns, a short answer after each."""
RENDERED_26 = {
    "qwen2_vl": "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n<|vision_start|>"
                "<|image_pad|><|vision_end|>What is this?<|im_end|>\n<|im_start|>assistant\nA cat.<|im_end|>\n"
                "<|im_start|>user\nAnd this?<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n<|im_start|>"
                "assistant\nA dog.<|im_end|>\n",
    "qwen3_vl": "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is this?<|im_end|>\n<|im_start|>"
                "assistant\nA cat.<|im_end|>\n<|im_start|>user\nAnd this?<|vision_start|><|image_pad|><|vision_end|>"
                "<|im_end|>\n<|im_start|>assistant\nA dog.<|im_end|>\n",
    "kimi_k25": "<|im_user|>user<|im_middle|><|media_begin|>image<|media_content|><|media_pad|><|media_end|>\nWhat is "
                "this?<|im_end|><|im_assistant|>assistant<|im_middle|><think></think>A cat.<|im_end|><|im_user|>user"
                "<|im_middle|>And this?<|media_begin|>image<|media_content|><|media_pad|><|media_end|>\n<|im_end|>"
                "<|im_assistant|>assistant<|im_middle|><think></think>A dog.<|im_end|>",
}
"""What the published templates render for it (transformers' apply_chat_template, HF's Jinja settings)."""


def renderer(family, **text) -> ChatRenderer:
    return ChatRenderer.of(family, TextConfig(**text), "llava")


def trained_text(family, layout) -> str:
    return family.tokenizer.decode([i for i, m in zip(layout.input_ids, layout.chat.loss_mask) if m])


def collapsed(layout, image_token_id: int) -> list[int]:
    """The ids with each image's span back to one image token: what the template rendered."""
    ids, keep = np.asarray(layout.input_ids), np.ones(len(layout.input_ids), dtype=bool)
    for start, length in layout.image_spans:
        keep[start + 1:start + length] = False
    assert (ids[~keep] == image_token_id).all()
    return ids[keep].tolist()


@pytest.fixture(scope="module")
def qwen():
    return load_family(ModelConfig(family="qwen2_vl"))


@pytest.fixture(scope="module")
def photos() -> list[np.ndarray]:
    return [pixels[..., :3] for name, pixels in demo_images() if name.split("[")[0] in ("chelsea", "coffee", "rocket")]


# -- roles ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("roles,ok", [
    (["system", "user", "assistant"], True),
    (["user", "assistant", "user", "assistant"], True),
    (["user", "assistant", "tool", "assistant"], True),
    (["assistant", "user"], False),  # an answer to nothing
    (["user", "user", "assistant"], False),
    (["user", "system", "assistant"], False),  # a system prompt only first
    (["system"], False),
    (["user", "gpt"], False),  # a role no template knows
])
def test_roles_must_be_known_and_in_order(roles, ok):
    turns = [Turn(role, ("hi",)) for role in roles]
    if ok:
        check_roles(turns)
        return
    with pytest.raises(CheckFailed) as caught:
        check_roles(turns)
    assert caught.value.check == "text.roles"


# -- layout with the tiny checkpoints' templates ---------------------------------------------------------------------
@pytest.mark.parametrize("name", ["qwen2_vl", "kimi_k25"])
def test_each_template_renders_the_conversation_as_published_and_images_expand_to_their_spans(name):
    family = load_family(ModelConfig(family=name))
    plans = [family.plan(120, 90), family.plan(56, 56)]
    layout = renderer(family).lay_out(CAT_AND_DOG, plans)
    assert family.tokenizer.decode(collapsed(layout, family.image_token_id)) == RENDERED_26[name]
    assert [length for _, length in layout.image_spans] == [plan.num_tokens for plan in plans]
    tags = np.asarray(layout.token_tags)
    assert (tags == IMAGE).sum() == sum(plan.num_tokens for plan in plans)
    for start, length in layout.image_spans:
        assert tags[start - 1] == FRAME and tags[start + length] == FRAME
    assert trained_text(family, layout) == "A cat.<|im_end|>A dog.<|im_end|>"


def test_train_on_chooses_every_assistant_turn_the_last_one_or_everything_but_images(qwen):
    plans = [qwen.plan(120, 90), qwen.plan(56, 56)]
    last = renderer(qwen, train_on="last_assistant").lay_out(CAT_AND_DOG, plans)
    assert trained_text(qwen, last) == "A dog.<|im_end|>"
    everything = renderer(qwen, train_on="all").lay_out(CAT_AND_DOG, plans)
    mask, tags = np.asarray(everything.chat.loss_mask), np.asarray(everything.token_tags)
    assert (mask == (tags != IMAGE)).all()


def test_turns_partition_the_sequence_up_to_the_last_end_of_turn_token(qwen):
    layout = renderer(qwen).lay_out(CAT_AND_DOG, [qwen.plan(120, 90), qwen.plan(56, 56)])
    spans = layout.chat.turns
    assert [s.role for s in spans] == ["user", "assistant", "user", "assistant"]
    assert spans[0].start == 0 and all(a.end == b.start for a, b in zip(spans, spans[1:]))
    ids = layout.input_ids
    assert all(qwen.tokenizer.convert_ids_to_tokens(ids[s.end - 1]) == "<|im_end|>" for s in spans)
    assert qwen.tokenizer.decode(ids[spans[-1].end:]) == "\n"  # the template's last newline belongs to no turn


def test_a_mask_never_covers_an_image_even_in_an_assistant_turn(qwen):
    """Qwen2-VL renders images in any role; an image in an assistant turn is still not a target."""
    turns = [Turn("user", ("Draw a cat.",)), Turn("assistant", ("Here:", None, " a cat."))]
    layout = renderer(qwen).lay_out(turns, [qwen.plan(120, 90)])
    mask, tags = np.asarray(layout.chat.loss_mask), np.asarray(layout.token_tags)
    assert mask[tags == IMAGE].sum() == 0
    assert trained_text(qwen, layout) == "Here:<|vision_start|><|vision_end|> a cat.<|im_end|>"


def test_a_conversation_without_an_answer_has_no_trained_token(qwen):
    with pytest.raises(CheckFailed) as caught:
        renderer(qwen).lay_out([Turn("user", ("Hello?",))], [])
    assert caught.value.check == "text.no_trained_tokens"


def test_the_template_renders_at_most_twice_per_conversation_whatever_its_number_of_turns(qwen, monkeypatch):
    """The mask comes from two renderings (the conversation, and its texts marked, once per shape of conversation): a
    mask that rendered every prefix would cost quadratic time in the turns."""
    calls = []
    render = type(qwen.tokenizer).apply_chat_template
    monkeypatch.setattr(type(qwen.tokenizer), "apply_chat_template",
                        lambda self, *a, **k: calls.append(1) or render(self, *a, **k))
    chat = renderer(qwen)
    for pairs in (1, 8, 32):
        calls.clear()
        turns = [Turn(role, (f"{role} {i}",)) for i in range(pairs) for role in ("user", "assistant")]
        layout = chat.lay_out(turns, [])
        assert len(calls) == 2 and sum(s.role == "assistant" for s in layout.chat.turns) == pairs
        calls.clear()  # the same roles and images, other texts: the marked rendering is kept
        chat.lay_out([Turn(turn.role, (f"other {turn.content[0]}",)) for turn in turns], [])
        assert len(calls) == 1


def test_a_template_that_drops_an_image_is_caught(qwen, tmp_path):
    """Qwen3-VL's template renders no image in an assistant turn: the record cannot be laid out, and says so."""
    family = load_family(ModelConfig(family="qwen2_vl", chat_template=str(TEMPLATES / "qwen3_vl.jinja")))
    turns = [Turn("user", ("Draw a cat.",)), Turn("assistant", ("Here:", None))]
    with pytest.raises(CheckFailed) as caught:
        renderer(family).lay_out(turns, [family.plan(120, 90)])
    assert caught.value.check == "text.chat_template"


def test_a_template_that_raises_is_a_chat_template_failure(qwen, tmp_path):
    template = tmp_path / "strict.jinja"
    template.write_text("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system') }}"
                        "{% endif %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
                        "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|>"
                        "<|image_pad|><|vision_end|>{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
                        "<|im_end|>\n{% endfor %}")
    family = load_family(ModelConfig(family="qwen2_vl", chat_template=str(template)))
    with pytest.raises(CheckFailed) as caught:
        renderer(family).lay_out([Turn("system", ("Be brief.",)), Turn("user", ("Hi",)),
                                  Turn("assistant", ("Hello",))], [])
    assert caught.value.check == "text.chat_template" and "no system" in caught.value.message


def test_a_bos_the_template_renders_is_not_added_twice(tmp_path):
    """A template that renders the BOS itself, with a tokenizer that adds one: the ids start with one BOS."""
    from tokenizers import processors

    family = load_family(ModelConfig(family="qwen2_vl"))
    family.tokenizer = tokenizer = copy.deepcopy(family.tokenizer)  # a process shares a checkpoint's tokenizer
    bos = tokenizer.bos_token_id
    tokenizer._tokenizer.post_processor = processors.TemplateProcessing(single=f"{tokenizer.bos_token} $A",
                                                                          special_tokens=[(tokenizer.bos_token, bos)])
    assert tokenizer("x")["input_ids"][0] == bos
    tokenizer.chat_template = "{{ bos_token }}" + tokenizer.chat_template
    layout = renderer(family).lay_out(CAT_AND_DOG[:2], [family.plan(120, 90)])
    assert layout.input_ids[0] == bos and layout.input_ids[1] != bos


# -- length -----------------------------------------------------------------------------------------------------------
def long_conversation(pairs: int) -> list[Turn]:
    return [Turn("user", (None, "Describe it.") if i == 0 else ("And now?", None)) if role == "user"
            else Turn("assistant", (f"Answer number {i}, a longer one.",)) for i in range(pairs)
            for role in ("user", "assistant")]


def within_limit(family, turns, plans, **text) -> TokenLayout:
    """A conversation laid out as the job lays it out, text.max_tokens enforced where it is for every format."""
    return laid_out(Conversation(renderer(family, **text), "prepend"), turns, plans, TextConfig(**text))


def test_a_record_over_max_tokens_is_quarantined_naming_the_turn_where_it_overflows(qwen):
    turns, plans = long_conversation(3), [qwen.plan(112, 112)] * 3
    full = renderer(qwen).lay_out(turns, plans)
    limit = full.chat.turns[3].end  # up to the second answer
    with pytest.raises(CheckFailed) as caught:
        within_limit(qwen, turns, plans, max_tokens=limit)
    assert caught.value.check == "text.too_long" and caught.value.turn_index == 4
    assert f"more than text.max_tokens={limit}; turn 4 (user) ends at token" in str(caught.value)


def test_a_plain_text_over_max_tokens_is_quarantined_by_the_same_rule(qwen):
    """One place enforces text.max_tokens, whatever the format: a plain text has no turn to name."""
    side = PlainText(qwen, "<image>", "prepend", "quarantine")
    layout = side.lay_out("<image> a photograph of something", [qwen.plan(112, 112)])
    with pytest.raises(CheckFailed, match=rf"{len(layout.input_ids)} tokens, more than text.max_tokens=5$") as caught:
        laid_out(side, "<image> a photograph of something", [qwen.plan(112, 112)], TextConfig(max_tokens=5))
    assert caught.value.turn_index is None


def test_drop_turns_keeps_whole_turns_up_to_an_answer_and_never_part_of_an_image(qwen):
    turns, plans = long_conversation(3), [qwen.plan(112, 112)] * 3
    full = renderer(qwen).lay_out(turns, plans)
    image_start = full.image_spans[2][0]
    # A limit inside the third image's span: its turn and the answer after it go, whole.
    cut = within_limit(qwen, turns, plans, max_tokens=image_start + 3, overflow="drop_turns")
    assert cut.chat.dropped_turns == 2 and [s.role for s in cut.chat.turns] == ["user", "assistant"] * 2
    assert len(cut.image_spans) == 2 and len(cut.input_ids) <= image_start + 3
    assert cut.input_ids == renderer(qwen).lay_out(turns[:4], plans[:2]).input_ids  # rendered again, not cut
    with pytest.raises(CheckFailed) as caught:  # not even the first answer fits
        within_limit(qwen, turns, plans, max_tokens=full.chat.turns[1].end - 1, overflow="drop_turns")
    assert caught.value.check == "text.too_long" and "no prefix of whole turns" in str(caught.value)


# -- oracles on the real Qwen2 vocabulary ------------------------------------------------------------------------------
def conversation_with(photos) -> tuple[list[Turn], list[dict]]:
    """A multi-turn, multi-image conversation with the BPE's pitfalls (digits, runs of spaces and newlines, accents,
    text glued to the images), as batchvlm's turns and as transformers' messages with the images in them."""
    turns = [Turn("system", ("You look at photos.  Answer in  one line.",)),
             Turn("user", ("Compare", None, "and\n\n", None, " -- which is older (1999 or 2024)?")),
             Turn("assistant", ("The first:  it's from 1999.\nThe second, café-style, 2024.",)),
             Turn("user", (None, "\nAnd this one?")),
             Turn("assistant", (" A rocket (Saturn V), 110 m tall. ",))]
    pictures = iter(Image.fromarray(photo) for photo in photos)
    messages = [{"role": turn.role, "content": [{"type": "image", "image": next(pictures)} if part is None else
                                                {"type": "text", "text": part} for part in turn.content]}
                for turn in turns]
    return turns, messages


def qwen_processor(family):
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    return Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor.from_pretrained(family.checkpoint),
                            video_processor=Qwen2VLVideoProcessor(), tokenizer=family.tokenizer,
                            chat_template=family.tokenizer.chat_template)


def test_ids_are_token_for_token_those_of_transformers_qwen2_vl_processor(qwen_real, photos):
    turns, messages = conversation_with(photos)
    plans = [qwen_real.plan(*photo.shape[:2]) for photo in photos]
    layout = renderer(qwen_real).lay_out(turns, plans)
    theirs = qwen_processor(qwen_real).apply_chat_template(messages, tokenize=True, return_dict=True)
    assert layout.input_ids == list(theirs["input_ids"][0])
    # and they are not the toy BPE's: the real vocabulary's ids
    assert max(layout.input_ids) == 151655 and qwen_real.tokenizer.encode("Hello world") == [9707, 1879]


def test_text_only_mask_equals_transformers_assistant_masks_from_a_generation_template(qwen_real):
    turns = [Turn("system", ("Be brief.",)), Turn("user", ("What is 12+30?",)), Turn("assistant", ("42.",)),
             Turn("user", ("  And 7 x 6 ?\n",)), Turn("assistant", ("\nAlso 42 -- twice.  ",))]
    layout = renderer(qwen_real).lay_out(turns, [])
    messages = [{"role": turn.role, "content": "".join(turn.content)} for turn in turns]
    theirs = qwen_real.tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
        chat_template=(TEMPLATES / "qwen2_vl_training.jinja").read_text())
    assert list(theirs["input_ids"]) == layout.input_ids
    assert sum(theirs["assistant_masks"]) > 0 and list(theirs["assistant_masks"]) == layout.chat.loss_mask


def mask_from_markers(ids: list[int], tokenizer) -> list[int]:
    """The Qwen finetune scripts' rule, on the expanded ids: after each `<|im_start|>assistant\\n`, through the next
    `<|im_end|>`."""
    start, end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    header = [start, *tokenizer.encode("assistant\n")]
    mask = [0] * len(ids)
    for i in range(len(ids) - len(header)):
        if ids[i:i + len(header)] == header:
            stop = ids.index(end, i + len(header))
            mask[i + len(header):stop + 1] = [1] * (stop + 1 - i - len(header))
    return mask


def test_with_images_the_mask_equals_the_one_derived_from_the_turns_markers(qwen_real, photos):
    """transformers measures `assistant_masks` before expanding the image tokens (#44521, #46559); ours is built on the
    expanded sequence, so images cannot shift it."""
    turns, _ = conversation_with(photos)
    layout = renderer(qwen_real).lay_out(turns, [qwen_real.plan(*photo.shape[:2]) for photo in photos])
    assert layout.chat.loss_mask == mask_from_markers(layout.input_ids, qwen_real.tokenizer)
    assert sum(layout.chat.loss_mask) > 20


@pytest.mark.parametrize("template,expected_tail", [
    ("qwen3_vl.jinja", RENDERED_26["qwen3_vl"]),
    ("qwen3_vl_thinking.jinja", "<|im_start|>assistant\nA cat.<|im_end|>\n<|im_start|>user\nAnd this?<|vision_start|>"
                                "<|image_pad|><|vision_end|><|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
                                "A dog.<|im_end|>\n"),
])
def test_qwen3_vl_renders_as_its_template_does_and_trains_the_answers_only(qwen_real_checkpoint, template,
                                                                          expected_tail):
    """The thinking template renders the last answer after an empty think block and the earlier ones without: the
    whole conversation is rendered at once, and the think block the template adds is not trained."""
    family = load_family(ModelConfig(family="qwen2_vl", path=str(qwen_real_checkpoint),
                                     chat_template=str(TEMPLATES / template)))
    layout = renderer(family).lay_out(CAT_AND_DOG, [family.plan(120, 90), family.plan(56, 56)])
    assert family.tokenizer.decode(collapsed(layout, family.image_token_id)).endswith(expected_tail)
    assert trained_text(family, layout) == "A cat.<|im_end|>A dog.<|im_end|>"


def test_the_renderer_refuses_a_checkpoint_without_a_chat_template_before_any_work():
    from batchvlm.config import ConfigError

    siglip = load_family(ModelConfig(family="siglip2"))
    with pytest.raises(ConfigError, match="model.chat_template"):
        ChatRenderer.of(siglip, TextConfig(), "messages")
    assert ChatRenderer.of(siglip, TextConfig(), "text") is None


def test_tags_outside_images_are_text_or_frame(qwen):
    layout = renderer(qwen).lay_out(CAT_AND_DOG, [qwen.plan(120, 90), qwen.plan(56, 56)])
    tags = np.asarray(layout.token_tags)
    frames = [qwen.tokenizer.convert_ids_to_tokens(i) for i, t in zip(layout.input_ids, tags) if t == FRAME]
    assert set(frames) == {"<|vision_start|>", "<|vision_end|>"} and set(tags.tolist()) == {TEXT, IMAGE, FRAME}

