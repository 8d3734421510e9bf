"""The token side of a record: placeholder expansion, span detection and token tags.

Family-independent: the family says what one image expands to; this module lays the record out
and finds the spans again in the ids, so that a layout bug cannot hide behind its own bookkeeping.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from functools import cache, partial

import numpy as np

from batchvlm.checks import CheckFailed, require
from batchvlm.format.schema import FRAME, TEXT, VIDEO
from batchvlm.records import ImagePlan, Slot, TokenLayout, Turn


def find_spans(input_ids: list[int] | np.ndarray, token_id: int) -> list[tuple[int, int]]:
    """Maximal runs of `token_id` as (start, length), detected without wrap-around.

    The mask is padded with False on both sides before differencing, so a sequence that starts and
    ends with an image token (or is nothing but one) still gives the right runs.
    """
    mask = np.zeros(len(input_ids) + 2, dtype=np.int8)
    mask[1:-1] = np.asarray(input_ids, dtype=np.int64) == token_id
    edges = np.diff(mask)
    starts = np.flatnonzero(edges == 1)
    stops = np.flatnonzero(edges == -1)
    return [(int(a), int(b - a)) for a, b in zip(starts, stops)]


def place_images(text: str, placeholder: str, num_images: int, missing_policy: str) -> str:
    """The text with exactly one placeholder per image, or a text.placeholder_count failure."""
    found = text.count(placeholder)
    if found == 0 and num_images and missing_policy == "prepend":
        return placeholder * num_images + text
    require(found == num_images, "text.placeholder_count",
            f"Expected {num_images} image placeholder(s) {placeholder!r}, found {found}.",
            expected=num_images, observed=found)
    return text


@contextmanager
def specials_as_text(backend):
    """The fast tokenizer reading its special tokens' strings as plain text, for the block's length; then the flag as
    it was (transformers' `split_special_tokens=True` leaves it set; a process shares the tokenizer)."""
    before, backend.encode_special_tokens = backend.encode_special_tokens, True
    try:
        yield backend
    finally:
        backend.encode_special_tokens = before


@cache
def special_ids(tokenizer) -> frozenset[int]:
    """The ids of the tokenizer's special tokens (its control tokens: `<|im_end|>`, `<|image_pad|>`...)."""
    return frozenset(i for i, token in tokenizer.added_tokens_decoder.items() if token.special)


def text_ids(family, text: str, control_tokens: str = "quarantine") -> list[int]:
    """A plain text's ids, with the checkpoint's tokenizer; text.control_token where the text holds a special token's
    string (text.control_tokens=text: read as plain text)."""
    ids = family.encode_text(text)
    specials = special_ids(family.tokenizer)
    forged = next((i for i in ids if i in specials), None)
    if forged is None:
        return ids
    if control_tokens == "text":
        with specials_as_text(family.tokenizer.backend_tokenizer) as plain:
            return plain.encode(text, add_special_tokens=False).ids
    name = family.tokenizer.convert_ids_to_tokens(forged)
    raise CheckFailed("text.control_token", f"the text holds {name!r}, a special token of the tokenizer "
                      "(text.control_tokens=text reads it as plain text)", expected="plain text", observed=name)


def place_conversation_images(turns: list[Turn], num_images: int, missing_policy: str,
                              num_videos: int = 0) -> list[Turn]:
    """The turns with one image slot per image: as read, or (none at all, missing_placeholder=prepend) the images at
    the front of the first user turn; and one clip slot per clip, as read; else a text.placeholder_count failure."""
    videos = sum(turn.num_videos for turn in turns)
    require(videos == num_videos, "text.placeholder_count", f"Expected {num_videos} video placeholder(s) (<video> or "
            f"{{type: video}}) across the conversation's turns, one per clip the record names, found {videos}.",
            expected=num_videos, observed=videos)
    found = sum(turn.num_images for turn in turns)
    first_user = next((i for i, turn in enumerate(turns) if turn.role == "user"), None)
    if found == 0 and num_images and missing_policy == "prepend" and first_user is not None:
        turn = turns[first_user]
        turns = [*turns[:first_user], Turn(turn.role, (None,) * num_images + turn.content), *turns[first_user + 1:]]
        found = num_images
    require(found == num_images, "text.placeholder_count", f"Expected {num_images} image placeholder(s) across the "
            f"conversation's turns, found {found}.", expected=num_images, observed=found)
    return turns


def build_layout(text: str, placeholder: str, plans: list[ImagePlan], family,
                 control_tokens: str = "quarantine", clip_plans: list = ()) -> TokenLayout:
    """Tokenize text pieces with the checkpoint's tokenizer and expand each placeholder via the family: an image's by
    `expand_image`, with `clip_plans` a clip's (`<video>`) by `clip_ids`."""
    if clip_plans:
        pieces = re.split(f"({re.escape(placeholder)}|{re.escape(Slot.VIDEO.value)})", text)
        texts, marks = pieces[0::2], pieces[1::2]
    else:
        texts = text.split(placeholder)
        marks = [placeholder] * (len(texts) - 1)
    media = {placeholder: (iter(plans), family.expand_image)}
    if clip_plans:
        media[Slot.VIDEO.value] = (iter(clip_plans), partial(clip_ids, family))
    input_ids: list[int] = []
    tags: list[int] = []
    for index, piece in enumerate(texts):
        ids = text_ids(family, piece, control_tokens)
        input_ids += ids
        tags += [TEXT] * len(ids)
        if index < len(marks):
            plans_left, expand = media[marks[index]]
            if (plan := next(plans_left, None)) is not None:
                media_ids, media_tags = expand(plan)
                input_ids += media_ids
                tags += media_tags
    video_spans = checked_spans(input_ids, [span for plan in clip_plans for span in plan.spans], family,
                                family.video_token_id) if clip_plans else []
    return TokenLayout(input_ids=input_ids, image_spans=checked_spans(input_ids, plans, family), token_tags=tags,
                       video_spans=video_spans)


def clip_ids(family, plan) -> tuple[list[int], list[int]]:
    """The ids (and tags) a plain text's `<video>` becomes: the family's prompt for the clip where it has one
    (Qwen3-VL's timestamps, Kimi-K2.5's chunks), tokenized apart (a plain text has no template to place it in), each
    video token expanded to its span; else `expand_video`."""
    prompt = getattr(family, "video_prompt", None)
    text = prompt(plan) if prompt is not None else None
    if text is None:
        return family.expand_video(plan)
    spans, ids, tags = iter(plan.spans), [], []
    for token in family.encode_text(text):
        count = next(spans).num_tokens if token == family.video_token_id else 1
        ids += [token] * count
        tag = VIDEO if token == family.video_token_id else FRAME if token in family.frame_token_ids else TEXT
        tags += [tag] * count
    return ids, tags


def checked_spans(input_ids: list[int] | np.ndarray, plans: list, family,
                  video_token_id: int | None = None) -> list[tuple[int, int]]:
    """The image spans (with `video_token_id`, the clips' spans) found again in the ids, one per image (clip), each
    as long as its plan says."""
    kind = "image" if video_token_id is None else "clip"
    spans = find_spans(input_ids, family.image_token_id if video_token_id is None else video_token_id)
    # Messages are formatted only for a failure: this runs on every record.
    if len(spans) != len(plans):
        raise CheckFailed("text.image_span_count", f"Expected one {kind} span per {kind}: {len(plans)} {kind}(s), "
                          f"{len(spans)} span(s) of {kind} tokens", expected=len(plans), observed=len(spans))
    for index, ((_, length), plan) in enumerate(zip(spans, plans)):
        if length != plan.num_tokens:
            where = {"image_index": index} if video_token_id is None else {"video_index": index}
            raise CheckFailed("text.span_length", f"span of {kind} {index} has {length} tokens, its plan has "
                              f"{plan.num_tokens}", expected=plan.num_tokens, observed=length, **where)
    return spans


def require_fits(layout: TokenLayout, max_tokens: int | None, dropped: bool = False) -> None:
    """text.too_long where the record is over text.max_tokens: the one place the limit is enforced, for a plain text
    and a conversation alike (a conversation's message names the turn where the limit falls; `dropped`: it was
    already cut to the longest prefix of whole turns that could be, text.overflow=drop_turns, and none fits)."""
    length = len(layout.input_ids)
    if max_tokens is None or length <= max_tokens:
        return
    message, over = f"{length} tokens, more than text.max_tokens={max_tokens}", None
    if layout.chat is not None:
        spans = layout.chat.turns
        # past the last turn's end (a template's last newline belongs to no turn), the last turn
        over = next((i for i, span in enumerate(spans) if span.end > max_tokens), len(spans) - 1)
        message += f"; turn {over} ({spans[over].role}) ends at token {spans[over].end}"
        if dropped:
            message += ": no prefix of whole turns ending with an assistant turn fits"
    raise CheckFailed("text.too_long", message, expected=f"<= {max_tokens} tokens", observed=f"{length} tokens",
                      turn_index=over)


def attach_positions(layout: TokenLayout, plans: list[ImagePlan], family, clip_plans: list = ()) -> None:
    """The family's position ids (M-RoPE), checked against the sequence they must cover: with clips, over the
    images' and clips' spans in sequence order."""
    found = family.positions(layout, plans, clip_plans)
    if found is None:
        return
    positions, delta = found
    seq = len(layout.input_ids)
    require(positions.shape == (3, seq), "text.position_ids", f"position ids of shape {positions.shape} for a "
            f"sequence of {seq} tokens", expected=(3, seq), observed=positions.shape)
    expected_delta = int(positions.max(initial=-1)) + 1 - seq  # an empty sequence has no positions: delta 0
    require(delta == expected_delta, "text.position_ids", "rope delta must be max position + 1 - sequence length",
            expected=expected_delta, observed=delta)
    layout.position_ids, layout.rope_delta = positions, delta
