"""The text side of a conversation: rendered with the checkpoint's own chat template, tokenized, images expanded,
and the tokens a trainer learns from marked on the expanded sequence.

The template is rendered by transformers' own renderer (`apply_chat_template`), with each image as a `{type: image}`
block, which every shipped VLM template renders as its family's single image token. Where each turn's text lies is
known by construction, never by searching the rendered text for it (an answer "a" or "im" is also in the template's
own text): the conversation is rendered a second time with each text replaced by a marker the template cannot hold
(a private-use character around the text's index), the markers give the template's own text between the turns' texts,
and the template's text and the turns' texts put back together must give the first rendering, character for
character, which proves where each text lies (a template that rewrites a text, trimming it or splitting it at
`</think>`, fails text.chat_template, naming the turn). The rendering is tokenized once, with character offsets: the
tokens holding a character of a text are its tokens (a token that merges a header character with the text's first,
BPE across the boundary, is the text's), and a special token among them is a control token the text forged
(text.control_token; text.control_tokens=text tokenizes those texts' control strings as plain text). At most two
renderings per conversation, whatever its number of turns (the marked one is kept by the conversation's shape: its
roles and where its images sit): no `{% generation %}` markers needed (no shipped Qwen-VL or Kimi template has
them), no rendering of prefixes (quadratic in the turns). Each image token is expanded to its
grid-sized span last, so the mask moves with the tokens and an image cannot shift it (transformers computes
`assistant_masks` before the expansion, which shifts or empties them: transformers #44521, #46559).

Trained, as LLaMA-Factory, the Qwen finetune scripts and TRL's training templates do: the content of an assistant
turn and its end-of-turn token (the first special token after the content). Not trained: system, user and tool
turns, image tokens, the assistant header and whatever the template puts before the content.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from itertools import accumulate
from typing import ClassVar

import numpy as np

from batchvlm.checks import CheckFailed, require
from batchvlm.config import Choice, Config, ConfigError, positive, written
from batchvlm.format.schema import FRAME, IMAGE, TEXT, VIDEO
from batchvlm.pipeline.tokens import checked_spans, special_ids, specials_as_text
from batchvlm.records import ROLES, ChatLayout, ImagePlan, Slot, TokenLayout, Turn, TurnSpan


class TrainOn(Choice):
    auto = "auto"
    assistant = "assistant"
    last_assistant = "last_assistant"
    all = "all"


class ControlTokens(Choice):
    quarantine = "quarantine"
    text = "text"


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
    control_tokens: ControlTokens = written(ControlTokens.quarantine)
    """A text (any turn's content, a plain text) holding a string the tokenizer reads as one of its special tokens
    (`<|im_end|>`, `<|image_pad|>`...): quarantine (text.control_token: it would forge turns or images) | text
    (tokenized as plain text, as any other characters)."""

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


def text_slots(turns: list[Turn]) -> list[tuple[int, str]]:
    """(turn index, text) of each text the template renders, in order: a turn without images or clips is one text
    (its parts joined, maybe empty), a turn with some one text per text part."""
    return [(index, part) for index, turn in enumerate(turns)
            for part in (turn.content if turn.has_media else ("".join(turn.content),)) if isinstance(part, str)]


def messages_of(turns: list[Turn], texts: list[str] | None = None) -> list[dict]:
    """HF `messages`: a turn without images or clips as a string, one with some as text, `{type: image}` and
    `{type: video}` blocks; with `texts`, the turns' texts (text_slots' order) replaced by them."""
    replaced = iter(texts) if texts is not None else None

    def text(part: str) -> str:
        return part if replaced is None else next(replaced)

    def block(part: str | Slot | None) -> dict:
        if part is None:
            return {"type": "image"}
        return {"type": "video"} if part is Slot.VIDEO else {"type": "text", "text": text(part)}

    return [{"role": turn.role,
             "content": [block(part) for part in turn.content] if turn.has_media else text("".join(turn.content))}
            for turn in turns]


NONE = np.zeros(0, dtype=np.int64)
PROBE_IMAGE = (56, 56)
"""The size of the image in the conversation the tokenizer is probed with at start."""
SHAPES = 4096
"""Conversation shapes (roles, where the images sit) whose template text a renderer keeps."""
MARKS = range(0xE000, 0xF900)
"""Unicode's private use area: a turn's text is rendered as its index between two of one of these characters, one
that neither the template nor the conversation holds."""


@dataclass
class Encoded:
    """A rendered conversation's tokens, each with the characters [start, end) of the rendering it covers (made
    non-decreasing: a token the post-processor adds covers none), and whether the post-processor added it."""

    ids: np.ndarray  # [n] int64
    starts: np.ndarray  # [n]
    ends: np.ndarray  # [n]
    added: np.ndarray  # [n] bool

    @classmethod
    def of(cls, encoding, at: int = 0) -> Encoded:
        """A tokenizer's encoding of the piece of the rendering that starts at character `at`."""
        offsets = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2) + at
        return cls.joined([cls(np.asarray(encoding.ids, dtype=np.int64), offsets[:, 0], offsets[:, 1],
                               np.asarray(encoding.special_tokens_mask, dtype=bool))])

    @classmethod
    def joined(cls, pieces: list[Encoded]) -> Encoded:
        ids, starts, ends, added = (np.concatenate([getattr(piece, name) for piece in pieces])
                                    for name in ("ids", "starts", "ends", "added"))
        return cls(ids, np.maximum.accumulate(starts), np.maximum.accumulate(ends), added)

    def __getitem__(self, tokens) -> Encoded:
        return Encoded(self.ids[tokens], self.starts[tokens], self.ends[tokens], self.added[tokens])

    def span(self, start: int, end: int) -> tuple[int, int]:
        """The tokens [first, last) holding a character of [start, end): a token that merges a template character
        with the text's (BPE across the boundary) is the text's; an empty text is the empty range where it falls."""
        if start == end:
            at = int(np.searchsorted(self.starts, start, "left"))
            return at, at
        return int(np.searchsorted(self.ends, start, "right")), int(np.searchsorted(self.starts, end, "left"))


@dataclass
class Rendered:
    """A conversation rendered and tokenized, before the images are expanded."""

    ids: np.ndarray  # [n] int64
    content: list[tuple[int, int] | None]  # per turn, its content's token range [start, end); None: no content
    ends: list[int]  # per turn, one past its last token (its end-of-turn token)
    prompted: np.ndarray | None = None  # [n] bool: tokens of the family's clip prompts (Qwen3-VL's, Kimi-K2.5's)


class ChatRenderer:
    """A family's tokenizer with the chat template its conversations are rendered with (the checkpoint's own, or
    model.chat_template's)."""

    def __init__(self, family, template: str, text: TextConfig, format: str):
        self.family, self.template, self.text = family, template, text
        self.train_on = text.trained(format)
        tokenizer = family.tokenizer
        self.tokenizer = tokenizer
        # Lookup tables over the vocabulary: which ids are special tokens, which of those close a turn (no image or
        # frame token), which are frame tokens. A table costs a byte an id and answers a whole sequence in one gather.
        size = max(len(tokenizer), max(tokenizer.added_tokens_decoder, default=0) + 1)
        self.is_frame = np.zeros(size, dtype=bool)
        self.is_frame[sorted(family.frame_token_ids)] = True
        self.is_special = np.zeros(size, dtype=bool)
        self.is_special[sorted(special_ids(tokenizer))] = True
        self.closes = self.is_special & ~self.is_frame
        self.closes[family.image_token_id] = False
        # A family with a clip rule has a video token: a clip's place, never a turn's end (-1: no clip is rendered).
        self.video_token_id = getattr(family, "video_token_id", None) if getattr(family, "video_rule", None) else None
        if self.video_token_id is not None:
            self.closes[self.video_token_id] = False
        self.bos = tokenizer.bos_token
        self.template_chars = set(template)
        self.shapes: dict[tuple, tuple[str, ...]] = {}  # _around's
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
        chat = cls(family, template, text, format)
        chat.probe()
        return chat

    def probe(self) -> None:
        """ConfigError before any work where the tokenizer cannot encode the template (a template of another family,
        or of no special token closing a turn): a question on an image and its answer must lay out, the answer
        trained, as every record's would."""
        try:
            self._expanded([Turn("user", (None, "What is it?")), Turn("assistant", ("A photo.",))],
                           [self.family.plan(*PROBE_IMAGE)])
        except CheckFailed as failed:
            raise ConfigError(f"model.chat_template / model.tokenizer_path: the tokenizer of {self.family.checkpoint} "
                              f"cannot encode the chat template: [{failed.check}] {failed.message}") from None

    # -- render and tokenize ------------------------------------------------------------------------
    def render(self, turns: list[Turn], texts: list[str] | None = None) -> str:
        """The conversation rendered, its texts replaced by `texts` where given."""
        try:
            return self.tokenizer.apply_chat_template(messages_of(turns, texts), tokenize=False,
                                                      chat_template=self.template)
        except Exception as error:  # Jinja's errors and the template's own raise_exception
            raise CheckFailed("text.chat_template", f"the chat template does not render the conversation: "
                              f"{type(error).__name__}: {error}", expected="a rendered conversation",
                              observed=type(error).__name__) from None

    def placed(self, turns: list[Turn]) -> tuple[str, list[tuple[int, str]], list[tuple[int, int]]]:
        """The rendered conversation, its texts (text_slots) and the characters [start, end) of each in it, by
        construction: the template's own text around the turns' texts (from a rendering with markers), the texts put
        back in between, must give the rendering, character for character."""
        text = self.render(turns)
        slots = text_slots(turns)
        spans, at = [], 0
        around = self._around(turns, self._mark([piece for _, piece in slots]), len(slots))
        for between, (index, piece) in zip(around, slots):
            if not (text.startswith(between, at) and text.startswith(piece, at + len(between))):
                raise self._rewritten(turns, index)
            at += len(between)
            spans.append((at, at + len(piece)))
            at += len(piece)
        if text[at:] != around[-1]:
            raise self._rewritten(turns, slots[-1][0] if slots else 0)
        return text, slots, spans

    def _around(self, turns: list[Turn], mark: str, count: int) -> tuple[str, ...]:
        """The template's own text before, between and after the conversation's `count` texts: its rendering with
        each text replaced by a marker (`mark`, the text's index, `mark`). It depends on the turns' roles and where
        their images sit, not on their texts: kept by that shape, so a dataset's conversations, mostly of a few
        shapes, cost one rendering each."""
        shape = (mark, *((turn.role, turn.has_media and tuple("text" if isinstance(part, str) else part
                                                              for part in turn.content)) for turn in turns))
        if (around := self.shapes.get(shape)) is not None:
            return around
        marked = self.render(turns, [f"{mark}{k}{mark}" for k in range(count)])
        found = list(re.finditer(f"{mark}([0-9]+){mark}", marked))
        if [int(m.group(1)) for m in found] != list(range(count)):
            slots = text_slots(turns)
            counts = np.bincount([int(m.group(1)) for m in found], minlength=count)
            wrong = next((k for k in range(count) if counts[k] != 1), count - 1)
            raise CheckFailed("text.chat_template", f"the chat template renders turn {slots[wrong][0]}'s text "
                              f"{counts[wrong]} times, or out of order", expected="each turn's text once, in order",
                              observed=f"{counts[wrong]} time(s)", turn_index=slots[wrong][0])
        ends = [0, *(m.end() for m in found)]
        starts = [*(m.start() for m in found), len(marked)]
        if len(self.shapes) >= SHAPES:
            self.shapes.clear()
        around = self.shapes[shape] = tuple(marked[end:start] for end, start in zip(ends, starts))
        return around

    def _mark(self, texts: list[str]) -> str:
        """A private-use character in neither the template nor the texts."""
        for code in MARKS:
            if (mark := chr(code)) not in self.template_chars and not any(mark in text for text in texts):
                return mark
        raise CheckFailed("text.chat_template", "the conversation holds every private-use character: its turns "
                          "cannot be marked", expected="a free private-use character", observed="none")

    @staticmethod
    def _rewritten(turns: list[Turn], index: int) -> CheckFailed:
        return CheckFailed("text.chat_template", f"the chat template does not render turn {index} "
                           f"({turns[index].role}) verbatim: it rewrites its text (trims it, splits it...)",
                           expected="every turn's text verbatim", observed="rewritten", turn_index=index)

    def _encode(self, text: str) -> Encoded:
        # As transformers' processors do: a template that renders the BOS itself gets no second one. (The fast
        # tokenizer's own encoder: what its __call__ runs, without the Python around it.)
        adds = self.adds_special and not (self.bos and text.startswith(self.bos))
        return Encoded.of(self.tokenizer.backend_tokenizer.encode(text, add_special_tokens=adds))

    def _as_text(self, text: str, encoded: Encoded, inside: np.ndarray) -> Encoded:
        """text.control_tokens=text: the rendering tokenized again with the turns' texts' control strings as plain
        text. The template's special tokens split a tokenization into independent runs, so the runs between them
        are tokenized apart, by the tokenizer with its special tokens off; the template's special tokens, and those
        the post-processor adds around the whole, stay as they were."""
        real = np.flatnonzero(~encoded.added)
        first, last = (int(real[0]), int(real[-1]) + 1) if real.size else (0, 0)
        pieces, at = [encoded[:first]], 0
        with specials_as_text(self.tokenizer.backend_tokenizer) as plain:
            for token in np.flatnonzero(self.is_special[encoded.ids] & ~inside & ~encoded.added):
                start = int(encoded.starts[token])
                pieces += [Encoded.of(plain.encode(text[at:start], add_special_tokens=False), at), encoded[[token]]]
                at = int(encoded.ends[token])
            pieces += [Encoded.of(plain.encode(text[at:], add_special_tokens=False), at), encoded[last:]]
        return Encoded.joined(pieces)

    def tokenize(self, turns: list[Turn], clip_plans: list = ()) -> Rendered:
        text, slots, spans = self.placed(turns)
        prompt = getattr(self.family, "video_prompt", None)  # None: a family whose clip is its template's token
        prompts = [prompt(plan) for plan in clip_plans] if clip_plans and prompt is not None else []
        inserted = []
        if prompts and prompts[0] is not None:
            text, spans, inserted = self._with_prompts(text, spans, prompts)
        encoded = self._encode(text)
        ranges = [encoded.span(*span) for span in spans]
        inside = np.zeros(len(encoded.ids) + 1, dtype=np.int64)
        for first, last in ranges:
            inside[first] += 1
            inside[last] -= 1
        inside = np.cumsum(inside[:-1]) > 0
        if (forged := np.flatnonzero(inside & self.is_special[encoded.ids])).size:
            if self.text.control_tokens != "text":
                raise self._forged(encoded, forged[0], ranges, slots)
            encoded = self._as_text(text, encoded, inside)
            ranges = [encoded.span(*span) for span in spans]
        images = self._media_tokens(encoded.ids, self.family.image_token_id, sum(t.num_images for t in turns), "image")
        # a clip is one video token where the template's rendering stands, one per span where its prompt replaced it
        spans_per_clip = ([len(plan.spans) for plan in clip_plans] if inserted
                          else [1] * sum(turn.num_videos for turn in turns))
        videos = self._media_tokens(encoded.ids, self.video_token_id, sum(spans_per_clip), "video")
        # a clip of several spans (Qwen3-VL) is one piece of its turn, from its first span's token to its last's
        lasts = accumulate(spans_per_clip)
        clips = [(int(videos[last - count]), int(videos[last - 1]) + 1) for last, count in zip(lasts, spans_per_clip)]
        rendered = self._turns(turns, encoded.ids, slots, ranges,
                               {None: [(int(i), int(i) + 1) for i in images], Slot.VIDEO: clips})
        if inserted:
            rendered.prompted = np.zeros(len(encoded.ids), dtype=bool)
            for start, end in inserted:
                rendered.prompted |= (encoded.starts < end) & (encoded.ends > start)
        return rendered

    def _with_prompts(self, text: str, spans: list[tuple[int, int]],
                      prompts: list[str]) -> tuple[str, list[tuple[int, int]], list[tuple[int, int]]]:
        """The rendering with each clip's place (its video token, with the family's frame tokens where the template
        puts them around it: Qwen's `<|vision_start|><|video_pad|><|vision_end|>`) replaced by the family's prompt
        for it, as its processor replaces it before tokenizing (the prompt's text tokenized with the text around it);
        the turns' texts' characters moved by what was inserted before them, and the prompts' characters. A video token inside a turn's text (text.control_tokens=text) is
        the text's, not a clip's: left as it is (tokenize counts the clips' tokens)."""
        pad = self.tokenizer.convert_ids_to_tokens(self.video_token_id)
        start, end = self.family.frame_tokens[0], self.family.frame_tokens[-1]  # what a template may put around it
        places = [m.start() for m in re.finditer(re.escape(pad), text)
                  if not any(first <= m.start() < last for first, last in spans)]
        if len(places) != len(prompts):
            raise CheckFailed("text.chat_template", f"the chat template renders {len(places)} video token(s) for "
                              f"{len(prompts)} video(s)", expected=len(prompts), observed=len(places))
        pieces, inserted, shifts, at, moved = [], [], [], 0, 0
        for place, prompt in zip(places, prompts):
            first, last = place, place + len(pad)
            if first >= len(start) and text.startswith(start, first - len(start)) and text.startswith(end, last):
                first, last = first - len(start), last + len(end)
            pieces += [text[at:first], prompt]
            inserted.append((first + moved, first + moved + len(prompt)))
            moved += len(prompt) - (last - first)
            shifts.append((last, moved))
            at = last
        pieces.append(text[at:])
        shift = lambda char: next((m for place, m in reversed(shifts) if char >= place), 0)  # noqa: E731
        return "".join(pieces), [(a + shift(a), b + shift(a)) for a, b in spans], inserted

    def _media_tokens(self, ids: np.ndarray, token: int | None, count: int, kind: str) -> np.ndarray:
        """Where the template rendered each image's (or clip's) token: one per image (clip), else text.chat_template. A
        conversation without clips is not searched for clip tokens: the template renders one only for a {type: video}
        block, and a text's own is text.control_token (or plain text) before this."""
        found = np.flatnonzero(ids == token) if token is not None and (count or kind == "image") else NONE
        if len(found) != count:
            raise CheckFailed("text.chat_template", f"the chat template renders {len(found)} {kind} token(s) for "
                              f"{count} {kind}(s)", expected=count, observed=len(found))
        return found

    def _forged(self, encoded: Encoded, token: int, ranges: list[tuple[int, int]],
                slots: list[tuple[int, str]]) -> CheckFailed:
        index = next(turn for (turn, _), (first, last) in zip(slots, ranges) if first <= token < last)
        name = self.tokenizer.convert_ids_to_tokens(int(encoded.ids[token]))
        return CheckFailed("text.control_token", f"turn {index}'s text holds {name!r}, a special token of the "
                           "tokenizer: it would be read as the template's own (text.control_tokens=text reads it as "
                           "plain text)", expected="plain text", observed=name, turn_index=index)

    def _turns(self, turns: list[Turn], ids: np.ndarray, slots: list[tuple[int, str]],
               ranges: list[tuple[int, int]], media: dict) -> Rendered:
        """Each turn's tokens: from its first text, image or clip token to its last, then its end-of-turn token, the
        first special token after them that is no image, clip or frame token (before the next turn's). `media`: the
        image (None) and clip (Slot.VIDEO) tokens' ranges [first, last), one per image and clip."""
        bounds = [[len(ids), 0] for _ in turns]
        pieces = list(zip((index for index, _ in slots), ranges))
        for kind, places in media.items():
            pieces += zip((index for index, turn in enumerate(turns) for part in turn.content if part is kind), places)
        for index, (first, last) in pieces:
            bounds[index] = [min(bounds[index][0], first), max(bounds[index][1], last)]
        closing = np.flatnonzero(self.closes[ids])
        content, ends = [], []
        for index, (turn, (first, last)) in enumerate(zip(turns, bounds)):
            after = int(np.searchsorted(closing, last))
            following = bounds[index + 1][0] if index + 1 < len(turns) else len(ids)
            if after == len(closing) or closing[after] >= following:
                raise CheckFailed("text.chat_template", f"turn {index} ({turn.role}) has no end-of-turn token after "
                                  "its content", expected="a special token closing the turn",
                                  observed="end of sequence" if after == len(closing) else "the next turn",
                                  turn_index=index)
            content.append((first, last) if last > first else None)
            ends.append(int(closing[after]) + 1)
        return Rendered(ids, content, ends)

    # -- expand and mask ------------------------------------------------------------------------------
    def lay_out(self, turns: list[Turn], plans: list[ImagePlan], clip_plans: list = ()) -> TokenLayout:
        """The conversation's token layout, with its loss mask and turns; over text.max_tokens with
        text.overflow=drop_turns, cut to fewer whole turns where some prefix fits. Whether it is within the limit is
        tokens.require_fits's to say, for every text (pipeline.text.laid_out)."""
        check_roles(turns)
        layout = self._expanded(turns, plans, clip_plans)
        limit = self.text.max_tokens
        if limit is None or len(layout.input_ids) <= limit or self.text.overflow != Overflow.drop_turns:
            return layout
        # The turn where the limit falls; past the last turn's end (a template's last newline belongs to no turn),
        # the last turn.
        over = next((i for i, span in enumerate(layout.chat.turns) if span.end > limit), len(layout.chat.turns) - 1)
        # The longest prefix of whole turns that ends with an assistant turn and fits. A template may render a turn
        # differently by its position, so the prefix is rendered again, not cut out of this rendering.
        for keep in range(over, 0, -1):
            if turns[keep - 1].role != "assistant":
                continue
            kept = self._expanded(turns[:keep], plans[:sum(t.num_images for t in turns[:keep])],
                                  clip_plans[:sum(t.num_videos for t in turns[:keep])])
            if len(kept.input_ids) <= limit:
                kept.chat.dropped_turns = len(turns) - keep
                return kept
        return layout

    def _expanded(self, turns: list[Turn], plans: list[ImagePlan], clip_plans: list = ()) -> TokenLayout:
        rendered = self.tokenize(turns, clip_plans)
        ids = rendered.ids
        is_image = ids == self.family.image_token_id
        # (a record without clips pays nothing for them: tokenize has found none of its ids a video token)
        is_video = ids == self.video_token_id if clip_plans else None
        mask = self._mask(turns, rendered, is_image if is_video is None else is_image | is_video)
        if rendered.prompted is not None:  # a clip's prompt is the model's to read, never trained
            mask[rendered.prompted] = 0
        # Each image (clip) token becomes its grid-sized span: every index after it moves by the span's length - 1.
        repeats = np.ones(len(ids), dtype=np.int64)
        repeats[is_image] = [plan.num_tokens for plan in plans]
        clip_spans = [span for plan in clip_plans for span in plan.spans]
        if is_video is not None:
            repeats[is_video] = [span.num_tokens for span in clip_spans]
        moved = np.concatenate([[0], np.cumsum(repeats)])
        expanded = np.repeat(ids, repeats)
        tags = np.where(self.is_frame[expanded], FRAME, TEXT).astype(np.int8)
        images = expanded == self.family.image_token_id
        tags[images] = IMAGE
        spans = [TurnSpan(turn.role, int(moved[start]), int(moved[end]))
                 for turn, start, end in zip(turns, [0, *rendered.ends[:-1]], rendered.ends)]
        loss_mask = np.repeat(mask, repeats)
        loss_mask[images] = 0
        if is_video is not None:
            videos = np.repeat(is_video, repeats)
            tags[videos] = VIDEO
            loss_mask[videos] = 0
        if not loss_mask.any():
            raise CheckFailed("text.no_trained_tokens", f"no token of the conversation is trained (text.train_on="
                              f"{self.train_on}; roles {[turn.role for turn in turns]})",
                              expected="at least one trained token", observed=0)
        video_spans = checked_spans(expanded, clip_spans, self.family, self.video_token_id) if clip_plans else []
        return TokenLayout(input_ids=expanded.tolist(), image_spans=checked_spans(expanded, plans, self.family),
                           token_tags=tags.tolist(), chat=ChatLayout(loss_mask.tolist(), spans),
                           video_spans=video_spans)

    def _mask(self, turns: list[Turn], rendered: Rendered, is_media: np.ndarray) -> np.ndarray:
        """Per rendered token, 1 where text.train_on trains it (never an image's or a clip's token)."""
        if self.train_on == "all":
            return (~is_media).astype(np.int8)
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
