"""The text side of a conversation: rendered with the checkpoint's own chat template, tokenized, images expanded,
and the tokens a trainer learns from marked on the expanded sequence.

The template is rendered once per conversation, by transformers' own renderer (`apply_chat_template`), with each
image as a `{type: image}` block, which every shipped VLM template renders as its family's single image token. The
rendered text is tokenized once, with character offsets; each turn's text is then found in the rendered text in turn
order, so a turn's tokens are known without `{% generation %}` markers (which no shipped Qwen-VL or Kimi template
has) and without rendering prefixes again (which would cost quadratic time in the turns). Each image token is
expanded to its grid-sized span last, so the mask moves with the tokens and an image cannot shift it (transformers
computes `assistant_masks` before the expansion, which shifts or empties them: transformers #44521, #46559).

Trained, as LLaMA-Factory, the Qwen finetune scripts and TRL's training templates do: the content of an assistant
turn and its end-of-turn token (the first special token after the content). Not trained: system, user and tool
turns, image tokens, the assistant header and whatever the template puts before the content.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from batchvlm.checks import CheckFailed, require
from batchvlm.config import Choice, Config, ConfigError, positive, written
from batchvlm.format.schema import FRAME, IMAGE, TEXT
from batchvlm.pipeline.tokens import checked_spans
from batchvlm.records import ROLES, ChatLayout, ImagePlan, TokenLayout, Turn, TurnSpan


class TrainOn(Choice):
    auto = "auto"
    assistant = "assistant"
    last_assistant = "last_assistant"
    all = "all"


class Overflow(Choice):
    quarantine = "quarantine"
    drop_turns = "drop_turns"


@dataclass
class TextConfig(Config):
    KEY: ClassVar[str] = "text"

    train_on: TrainOn = written(TrainOn.auto)
    """Which tokens a trainer learns to predict (the stored loss_mask): assistant (the content and end-of-turn token of
    every assistant turn) | last_assistant (of the last one only) | all (every token but image tokens) | auto
    (assistant for a conversation; all for dataset.format=text, which has no turns)."""
    max_tokens: int | None = written(None)
    """Tokens per record at most (the trainer's context length); null: no limit. A longer record is quarantined under
    text.too_long, or loses whole trailing turns (text.overflow)."""
    overflow: Overflow = written(Overflow.quarantine)
    """A record over text.max_tokens: quarantine (text.too_long) | drop_turns (a conversation keeps its longest prefix
    of whole turns that ends with an assistant turn and fits; never part of an image; the row records how many
    turns it lost)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_tokens is not None:
            positive("text.max_tokens", self.max_tokens)
        if self.overflow == Overflow.drop_turns and self.max_tokens is None:
            raise ConfigError("text.overflow=drop_turns needs text.max_tokens")

    def trained(self, format: str) -> TrainOn:
        """text.train_on resolved for a dataset format: auto trains assistant turns, or everything in plain text."""
        if self.train_on != TrainOn.auto:
            return self.train_on
        return TrainOn.all if format == "text" else TrainOn.assistant


FOLLOWS = {"system": (None,), "user": (None, "system", "assistant", "tool"), "assistant": ("user", "tool"),
           "tool": ("assistant", "tool")}
"""role -> the roles the turn before it may have (None: it may come first)."""


def check_roles(turns: list[Turn]) -> None:
    """text.roles: known roles, in an order a chat trainer builds."""
    require(any(turn.role != "system" for turn in turns), "text.roles", "the conversation has no turn besides the "
            "system prompt", expected="at least one user turn", observed=[turn.role for turn in turns])
    previous = None
    for index, turn in enumerate(turns):
        if turn.role not in ROLES:
            raise CheckFailed("text.roles", f"turn {index} has the role {turn.role!r}", expected=" | ".join(ROLES),
                              observed=repr(turn.role), turn_index=index)
        if previous not in FOLLOWS[turn.role]:
            allowed = " or ".join(map(str, FOLLOWS[turn.role]))
            raise CheckFailed("text.roles", f"turn {index} ({turn.role}) cannot follow {previous or 'the start'}",
                              expected=f"{turn.role} after {allowed}", observed=f"{turn.role} after {previous}",
                              turn_index=index)
        previous = turn.role


def messages_of(turns: list[Turn]) -> list[dict]:
    """HF `messages`: a turn without images as a string, one with images as text and `{type: image}` blocks."""
    return [{"role": turn.role,
             "content": "".join(turn.content) if not turn.num_images else
             [{"type": "image"} if part is None else {"type": "text", "text": part} for part in turn.content]}
            for turn in turns]


def token_range(encoded, start: int, end: int, length: int) -> tuple[int | None, int]:
    """The tokens [first, last) that overlap the characters [start, end) of a text of `length` characters: a token that
    merges a header character with the content's first letter (BPE across the boundary) is the content's, and so is
    one that runs past its end."""
    first = encoded.char_to_token(start)
    after = encoded.char_to_token(end) if end < length else None
    if after is None:
        return first, len(encoded.ids)
    return first, after + int(encoded.token_to_chars(after)[0] < end)


@dataclass
class Rendered:
    """A conversation rendered and tokenized, before the images are expanded."""

    ids: np.ndarray  # [n] int64
    content: list[tuple[int, int] | None]  # per turn, its content's token range [start, end); None: no content
    ends: list[int]  # per turn, one past its last token (its end-of-turn token, where it has one)


class ChatRenderer:
    """A family's tokenizer with the chat template its conversations are rendered with (the checkpoint's own, or
    model.chat_template's)."""

    def __init__(self, family, template: str, text: TextConfig, format: str):
        self.family, self.template, self.text = family, template, text
        self.train_on = text.trained(format)
        tokenizer = family.tokenizer
        self.tokenizer = tokenizer
        self.image_token = tokenizer.convert_ids_to_tokens(family.image_token_id)
        # Lookup tables over the vocabulary: which ids close a turn (special, but no image or frame token), which
        # are frame tokens. A table costs a byte an id and answers a whole sequence in one gather.
        size = max(len(tokenizer), max(tokenizer.added_tokens_decoder, default=0) + 1)
        self.is_frame = np.zeros(size, dtype=bool)
        self.is_frame[sorted(family.frame_token_ids)] = True
        self.closes = np.zeros(size, dtype=bool)
        self.closes[[i for i, token in tokenizer.added_tokens_decoder.items() if token.special]] = True
        self.closes[self.is_frame] = False
        self.closes[family.image_token_id] = False
        self.bos = tokenizer.bos_token
        # Whether the tokenizer adds special tokens at all (its post-processor costs as much as the encoding itself
        # where it adds none).
        backend = tokenizer.backend_tokenizer
        self.adds_special = backend.encode("a").ids != backend.encode("a", add_special_tokens=False).ids

    @classmethod
    def of(cls, family, text: TextConfig, format: str) -> ChatRenderer | None:
        """The renderer of a conversation format (None for dataset.format=text); ConfigError before any work where
        the tokenizer has no chat template (model.chat_template gives one)."""
        if format == "text":
            return None
        template = family.tokenizer.chat_template
        if not isinstance(template, str) or not template:
            raise ConfigError(f"dataset.format={format} renders conversations with the checkpoint's chat template, and "
                              f"{family.checkpoint} has none (or several by name): give one with "
                              "model.chat_template=<file.jinja>")
        return cls(family, template, text, format)

    # -- render and tokenize ------------------------------------------------------------------------
    def render(self, turns: list[Turn]) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages_of(turns), tokenize=False, chat_template=self.template)
        except Exception as error:  # Jinja's errors and the template's own raise_exception
            raise CheckFailed("text.chat_template", f"the chat template does not render the conversation: "
                              f"{type(error).__name__}: {error}", expected="a rendered conversation",
                              observed=type(error).__name__) from None

    def tokenize(self, turns: list[Turn]) -> Rendered:
        text = self.render(turns)
        # As transformers' processors do: a template that renders the BOS itself gets no second one. (The fast
        # tokenizer's own encoder: what its __call__ runs, without the Python around it.)
        encoded = self.tokenizer.backend_tokenizer.encode(
            text, add_special_tokens=self.adds_special and not (self.bos and text.startswith(self.bos)))
        ids = np.asarray(encoded.ids, dtype=np.int64)
        # The end of a turn is the first special token after its content that is no image or frame token.
        closing = np.flatnonzero(self.closes[ids])
        content, ends, cursor, token_cursor = [], [], 0, 0
        for index, turn in enumerate(turns):
            span, cursor = self._find_content(text, turn, cursor, index)
            if span is None:
                content.append(None)
                ends.append(token_cursor)
                continue
            first, last = token_range(encoded, *span, len(text))
            if first is None:  # a normalizer that dropped the content's first character
                raise CheckFailed("text.chat_template", f"turn {index} ({turn.role}): its content maps to no token",
                                  expected="the content's tokens", observed="none", turn_index=index)
            after = int(np.searchsorted(closing, last))
            if after == len(closing):
                raise CheckFailed("text.chat_template", f"turn {index} ({turn.role}) has no end-of-turn token after "
                                  "its content", expected="a special token closing the turn",
                                  observed="end of sequence", turn_index=index)
            content.append((first, last))
            token_cursor = int(closing[after]) + 1
            ends.append(token_cursor)
        return Rendered(ids, content, ends)

    def _find_content(self, text: str, turn: Turn, cursor: int, index: int) -> tuple[tuple[int, int] | None, int]:
        """The characters [start, end) of the turn's content in the rendered text, searched from `cursor` on in turn
        order, and where the search goes on; None where the turn has no content."""
        start = end = None
        for part in turn.content:
            piece = self.image_token if part is None else part
            if not piece:
                continue
            found = text.find(piece, cursor)
            if found < 0:
                raise CheckFailed("text.chat_template", f"the chat template does not render turn {index} "
                                  f"({turn.role}) verbatim: " + ("an image of it renders no image token" if part is None
                                                                 else f"its text {piece[:80]!r} is not in the rendered "
                                                                 "conversation"),
                                  expected="every turn's text and images, in order", observed="missing",
                                  turn_index=index)
            start = found if start is None else start
            end = cursor = found + len(piece)
        return (None if start is None else (start, end)), cursor

    # -- expand and mask ------------------------------------------------------------------------------
    def lay_out(self, turns: list[Turn], plans: list[ImagePlan]) -> TokenLayout:
        """The conversation's token layout, with its loss mask and turns; over text.max_tokens with
        text.overflow=drop_turns, cut to fewer whole turns where some prefix fits. Whether it is within the limit is
        tokens.require_fits's to say, for every text (pipeline.text.laid_out)."""
        check_roles(turns)
        layout = self._expanded(turns, plans)
        limit = self.text.max_tokens
        if limit is None or len(layout.input_ids) <= limit or self.text.overflow != Overflow.drop_turns:
            return layout
        over = next(i for i, span in enumerate(layout.chat.turns) if span.end > limit)
        # The longest prefix of whole turns that ends with an assistant turn and fits. A template may render a turn
        # differently by its position, so the prefix is rendered again, not cut out of this rendering.
        for keep in range(over, 0, -1):
            if turns[keep - 1].role != "assistant":
                continue
            kept = self._expanded(turns[:keep], plans[:sum(t.num_images for t in turns[:keep])])
            if len(kept.input_ids) <= limit:
                kept.chat.dropped_turns = len(turns) - keep
                return kept
        return layout

    def _expanded(self, turns: list[Turn], plans: list[ImagePlan]) -> TokenLayout:
        rendered = self.tokenize(turns)
        ids = rendered.ids
        is_image = ids == self.family.image_token_id
        if (rendered_images := int(is_image.sum())) != len(plans):
            raise CheckFailed("text.chat_template", f"the chat template renders {rendered_images} image token(s) for "
                              f"{len(plans)} image(s)", expected=len(plans), observed=rendered_images)
        mask = self._mask(turns, rendered, is_image)
        # Each image token becomes its grid-sized span: every index after it moves by the span's length - 1.
        repeats = np.ones(len(ids), dtype=np.int64)
        repeats[is_image] = [plan.num_tokens for plan in plans]
        moved = np.concatenate([[0], np.cumsum(repeats)])
        expanded = np.repeat(ids, repeats)
        tags = np.where(self.is_frame[expanded], FRAME, TEXT).astype(np.int8)
        images = expanded == self.family.image_token_id
        tags[images] = IMAGE
        spans = [TurnSpan(turn.role, int(moved[start]), int(moved[end]))
                 for turn, start, end in zip(turns, [0, *rendered.ends[:-1]], rendered.ends)]
        loss_mask = np.repeat(mask, repeats)
        loss_mask[images] = 0
        if not loss_mask.any():
            raise CheckFailed("text.no_trained_tokens", f"no token of the conversation is trained (text.train_on="
                              f"{self.train_on}; roles {[turn.role for turn in turns]})",
                              expected="at least one trained token", observed=0)
        return TokenLayout(input_ids=expanded.tolist(), image_spans=checked_spans(expanded, plans, self.family),
                           token_tags=tags.tolist(), chat=ChatLayout(loss_mask.tolist(), spans))

    def _mask(self, turns: list[Turn], rendered: Rendered, is_image: np.ndarray) -> np.ndarray:
        """Per rendered token, 1 where text.train_on trains it."""
        if self.train_on == "all":
            return (~is_image).astype(np.int8)
        mask = np.zeros(len(rendered.ids), dtype=np.int8)
        assistant = [i for i, turn in enumerate(turns) if turn.role == "assistant" and rendered.content[i] is not None]
        for index in assistant[-1:] if self.train_on == "last_assistant" else assistant:
            mask[rendered.content[index][0]:rendered.ends[index]] = 1
        return mask


def template_digest(family) -> str | None:
    """The sha256 of the chat template a conversation is rendered with (the checkpoint's, or model.chat_template's
    once loaded into the tokenizer): what the run's fingerprint holds of it, not the file's name."""
    template = family.tokenizer.chat_template
    return hashlib.sha256(template.encode()).hexdigest() if isinstance(template, str) else None
