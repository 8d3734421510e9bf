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
from batchvlm.records import Slot, Turn

LLAVA_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}
IMAGE_BLOCKS = ("image", "image_url")
VIDEO_BLOCKS = ("video", "video_url")
VIDEO_PLACEHOLDER = Slot.VIDEO.value
"""LLaVA's and Qwen's video placeholder (LLaMA-Factory's default too): a clip's place in a llava or messages turn.
Plain text (dataset.format=text) and The Cauldron have no video column: there it is quarantined (text.video)."""


def split_placeholders(text: str, placeholder: str, video: bool = False) -> tuple[str | Slot | None, ...]:
    """The text's pieces with None where each placeholder was (and, with `video`, Slot.VIDEO where each `<video>`
    was); the text around them unchanged."""
    parts: list[str | Slot | None] = []
    for index, piece in enumerate(text.split(VIDEO_PLACEHOLDER) if video else (text,)):
        if index:
            parts.append(Slot.VIDEO)
        pieces = piece.split(placeholder)
        parts.append(pieces[0])
        for rest in pieces[1:]:
            parts += [None, rest]
    return tuple(part for part in parts if part != "")


def _image_first(parts: tuple[str | None, ...]) -> tuple[str | None, ...]:
    """LLaVA's placement: a lone image taken out of its turn and put first, followed by a newline."""
    if sum(part is None for part in parts) != 1 or Slot.VIDEO in parts:
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


def _no_video(text: str, index: int, where: str = "a text block (a clip's place is a {type: video} block)") -> str:
    """text.video: a text where a clip cannot be placed holds no video placeholder."""
    require(VIDEO_PLACEHOLDER not in text, "text.video", f"turn {index} holds a {VIDEO_PLACEHOLDER} placeholder in "
            f"{where}", expected="text and images", observed=VIDEO_PLACEHOLDER, turn_index=index)
    return text


def llava_turns(value, placeholder: str, image_first: bool = False, column: str = "conversations") -> list[Turn]:
    turns = []
    for index, turn in enumerate(_turn_list(value, column)):
        speaker = _string(turn, "from", index)
        parts = split_placeholders(_string(turn, "value", index), placeholder, video=True)
        turns.append(Turn(LLAVA_ROLES.get(speaker, speaker), _image_first(parts) if image_first else parts))
    return turns


def _blocks(content: list, index: int) -> tuple[str | Slot | None, ...]:
    parts: list[str | Slot | None] = []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in IMAGE_BLOCKS or (isinstance(block, dict) and kind is None and "image" in block):
            parts.append(None)
        elif kind == "text":
            parts.append(_no_video(_string(block, "text", index), index))
        elif kind in VIDEO_BLOCKS:
            parts.append(Slot.VIDEO)
        else:
            raise CheckFailed("text.placeholder_count", f"turn {index} has a content block of type {kind!r}: "
                              "batchvlm takes text, image and video blocks", expected="text | image | video",
                              observed=repr(kind), turn_index=index)
    return tuple(part for part in parts if part != "")


def messages_turns(value, placeholder: str, column: str = "messages") -> list[Turn]:
    turns = []
    for index, turn in enumerate(_turn_list(value, column)):
        role, content = _string(turn, "role", index), turn.get("content")
        parts = _blocks(content, index) if isinstance(content, (list, tuple)) else \
            split_placeholders(_string(turn, "content", index), placeholder, video=True)
        turns.append(Turn(role, parts))
    return turns


CAULDRON = "The Cauldron's format, which has no video column"


def cauldron_turns(value, num_images: int, column: str = "texts") -> list[Turn]:
    turns = []
    for index, pair in enumerate(_turn_list(value, column)):
        user = _no_video(_string(pair, "user", 2 * index), 2 * index, CAULDRON)
        images = (None,) * num_images if index == 0 else ()
        turns += [Turn("user", images + ((user,) if user else ())),
                  Turn("assistant", (_no_video(_string(pair, "assistant", 2 * index + 1), 2 * index + 1, CAULDRON),))]
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
