"""Conversation formats users bring, read into turns (records.Turn), as their projects define them: LLaVA's
(github.com/haotian-liu/LLaVA, docs/Finetune_Custom_Data.md), HF / TRL's conversational `messages`
(huggingface.co/docs/trl, dataset formats), The Cauldron's (huggingface.co/datasets/HuggingFaceM4/the_cauldron).

- llava (LLaVA, ShareGPT4V, OneVision, Cambrian): `conversations` of {from: human | gpt | system, value}, the
  images in `image` (a path or a list of paths). The k-th placeholder of the conversation takes the k-th image and
  stays exactly where it is in its turn's text, as Qwen's finetune scripts keep it (dataset.image_first moves a
  lone one to the front of its turn, as LLaVA's own trainer does).
- messages (HF / TRL, LLaMA-Factory's sharegpt): `messages` of {role, content}, content a string (placeholders in
  it, LLaMA-Factory) or a list of {type: image} / {type: text, text} blocks, the images in `images`.
- cauldron (The Cauldron): `texts` of {user, assistant}; the images go before the first user turn's text.

A turns column may also hold its list as a JSON string. A conversation that names no image at all while the record
has images gets them at the front of its first user turn under dataset.missing_placeholder=prepend (TRL's rule).
"""

from __future__ import annotations

import json

from batchvlm.checks import CheckFailed, require
from batchvlm.format.strings import unencodable_fields
from batchvlm.records import Turn

LLAVA_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}
IMAGE_BLOCKS = ("image", "image_url")
VIDEO_BLOCKS = ("video", "video_url")
VIDEO_PLACEHOLDER = "<video>"
"""LLaVA's and Qwen's video placeholder (LLaMA-Factory's default too): a record with a video is quarantined
(text.video) until batchvlm embeds videos."""


def split_placeholders(text: str, placeholder: str) -> tuple[str | None, ...]:
    """The text's pieces with None where each placeholder was; the text around them unchanged."""
    pieces = text.split(placeholder)
    parts: list[str | None] = [pieces[0]]
    for piece in pieces[1:]:
        parts += [None, piece]
    return tuple(part for part in parts if part != "")


def _image_first(parts: tuple[str | None, ...]) -> tuple[str | None, ...]:
    """LLaVA's placement: a lone image taken out of its turn and put first, followed by a newline."""
    if sum(part is None for part in parts) != 1:
        return parts
    text = "".join(part for part in parts if part is not None).strip()
    return (None, "\n" + text)


def _turn_list(value, column: str) -> list:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise CheckFailed("text.roles", f"the {column!r} column is not a list of turns: {error}",
                              expected="a list of turns", observed="malformed JSON") from None
        require(not unencodable_fields({column: value}), "source.invalid_unicode", f"the {column!r} column's JSON "
                "holds a lone surrogate (an escape such as \\ud800)", expected="UTF-8 text", observed="a surrogate")
    require(isinstance(value, (list, tuple)) and all(isinstance(turn, dict) for turn in value), "text.roles",
            f"the {column!r} column is not a list of turns", expected="a list of turns",
            observed=type(value).__name__)
    return list(value)


def _string(turn: dict, key: str, index: int) -> str:
    """text.not_a_string: the turn's field is there and a string (never its str(): a number, a null, a list)."""
    value = turn.get(key)
    if not isinstance(value, str):
        raise CheckFailed("text.not_a_string", f"turn {index}'s {key!r} is " + (
            f"{type(value).__name__} {str(value)[:80]!r}, not a string" if key in turn
            else f"missing (the turn has {', '.join(map(str, turn)) or 'no field'})"),
            expected=f"{key}: a string", observed=type(value).__name__ if key in turn else "missing",
            turn_index=index)
    return value


def _no_video(text: str, index: int) -> str:
    """text.video: the text holds no video placeholder."""
    require(VIDEO_PLACEHOLDER not in text, "text.video", f"turn {index} holds a {VIDEO_PLACEHOLDER} placeholder: "
            "video is not supported yet", expected="text and images", observed=VIDEO_PLACEHOLDER, turn_index=index)
    return text


def _text(text: str, placeholder: str, index: int) -> tuple[str | None, ...]:
    """A turn's text as parts, None where each image placeholder was."""
    return split_placeholders(_no_video(text, index), placeholder)


def llava_turns(value, placeholder: str, image_first: bool = False, column: str = "conversations") -> list[Turn]:
    turns = []
    for index, turn in enumerate(_turn_list(value, column)):
        speaker = _string(turn, "from", index)
        parts = _text(_string(turn, "value", index), placeholder, index)
        turns.append(Turn(LLAVA_ROLES.get(speaker, speaker), _image_first(parts) if image_first else parts))
    return turns


def _blocks(content: list, index: int) -> tuple[str | None, ...]:
    parts: list[str | None] = []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in IMAGE_BLOCKS or (isinstance(block, dict) and kind is None and "image" in block):
            parts.append(None)
        elif kind == "text":
            parts.append(_no_video(_string(block, "text", index), index))
        elif kind in VIDEO_BLOCKS:
            raise CheckFailed("text.video", f"turn {index} holds a {kind} block: video is not supported yet",
                              expected="text and images", observed=kind, turn_index=index)
        else:
            raise CheckFailed("text.placeholder_count", f"turn {index} has a content block of type {kind!r}: "
                              "batchvlm takes text and image blocks", expected="text | image",
                              observed=repr(kind), turn_index=index)
    return tuple(part for part in parts if part != "")


def messages_turns(value, placeholder: str, column: str = "messages") -> list[Turn]:
    turns = []
    for index, turn in enumerate(_turn_list(value, column)):
        role, content = _string(turn, "role", index), turn.get("content")
        parts = _blocks(content, index) if isinstance(content, (list, tuple)) else \
            _text(_string(turn, "content", index), placeholder, index)
        turns.append(Turn(role, parts))
    return turns


def cauldron_turns(value, num_images: int, column: str = "texts") -> list[Turn]:
    turns = []
    for index, pair in enumerate(_turn_list(value, column)):
        user = _no_video(_string(pair, "user", 2 * index), 2 * index)
        images = (None,) * num_images if index == 0 else ()
        turns += [Turn("user", images + ((user,) if user else ())),
                  Turn("assistant", (_no_video(_string(pair, "assistant", 2 * index + 1), 2 * index + 1),))]
    return turns


def read_turns(format: str, value, placeholder: str, num_images: int, image_first: bool = False,
               column: str = "") -> list[Turn]:
    """The turns of a row's column in `format` (llava | messages | cauldron)."""
    if format == "llava":
        return llava_turns(value, placeholder, image_first, column)
    if format == "messages":
        return messages_turns(value, placeholder, column)
    return cauldron_turns(value, num_images, column)


def turns_text(turns: list[Turn], placeholder: str) -> str:
    """The turns as JSON, each image as the placeholder: a conversation's `text` in rows and reports."""
    return json.dumps([{"role": turn.role, "content": turn.text(placeholder)} for turn in turns], ensure_ascii=False)
