"""The text side of a record, whatever the dataset's format: its images placed in its text, then its token layout.

A plain text (dataset.format=text) is one string with a placeholder per image, tokenized piece by piece with each
placeholder expanded (pipeline.tokens); a conversation is rendered with its chat template (pipeline.chat). Both
answer the same two calls, so the job has one path for both, and text.max_tokens is enforced in one place
(`laid_out`, through tokens.require_fits) for both: a conversation with text.overflow=drop_turns is cut to fewer
whole turns first, where some prefix fits.
"""

from __future__ import annotations

from typing import Protocol

from batchvlm.checks import CheckFailed, require
from batchvlm.pipeline.chat import ChatRenderer, Overflow, TextConfig
from batchvlm.pipeline.tokens import build_layout, place_conversation_images, place_images, require_fits
from batchvlm.records import ImagePlan, Slot, SourceRecord, TokenLayout, Turn

VIDEO = Slot.VIDEO.value


class TextSide(Protocol):
    def placed(self, record: SourceRecord) -> str | list[Turn]:
        """The record's text with one image slot per image (text.placeholder_count otherwise)."""

    def lay_out(self, content: str | list[Turn], plans: list[ImagePlan], clip_plans: list = ()) -> TokenLayout:
        """The token layout of the placed text, each image (clip) expanded to its plan's tokens."""


class PlainText:
    def __init__(self, family, placeholder: str, missing_placeholder: str, control_tokens: str):
        self.family, self.placeholder, self.missing = family, placeholder, missing_placeholder
        self.control_tokens = control_tokens
        self.no_clips = clip_refusal(family, getattr(family, "video_token_id", None))

    def placed(self, record: SourceRecord) -> str:
        """The text with one placeholder per image, and one `<video>` per clip (a source reads clips into a plain
        text's record only where dataset.videos_column names their column: the text is its `<video>`'s only place)."""
        if record.videos or VIDEO in record.text:
            if self.no_clips is not None:
                refuse_clips(record, self.no_clips)
            found = record.text.count(VIDEO)
            require(found == len(record.videos), "text.placeholder_count", f"Expected {len(record.videos)} video "
                    f"placeholder(s) {VIDEO!r}, one per clip the record names, found {found}.",
                    expected=len(record.videos), observed=found)
        return place_images(record.text, self.placeholder, len(record.images), self.missing)

    def lay_out(self, text: str, plans: list[ImagePlan], clip_plans: list = ()) -> TokenLayout:
        return build_layout(text, self.placeholder, plans, self.family, self.control_tokens, clip_plans)


class Conversation:
    def __init__(self, renderer: ChatRenderer, missing_placeholder: str):
        self.renderer, self.missing = renderer, missing_placeholder
        self.no_clips = clip_refusal(renderer.family, renderer.video_token_id)

    def placed(self, record: SourceRecord) -> list[Turn]:
        if self.no_clips is not None:
            refuse_clips(record, self.no_clips)
        return place_conversation_images(record.turns, len(record.images), self.missing, len(record.videos))

    def lay_out(self, turns: list[Turn], plans: list[ImagePlan], clip_plans: list = ()) -> TokenLayout:
        return self.renderer.lay_out(turns, plans, clip_plans)


def clip_refusal(family, video_token_id: int | None) -> str | None:
    """What a clip is refused with where the family has no clip rule (then no video token); None where it has one."""
    if video_token_id is not None and getattr(family, "video_rule", None) is not None:
        return None
    return (f"model.family={family.name} ({getattr(family, 'version', family.name)}) has no video rule in batchvlm "
            "yet: its clips are not embedded")


def refuse_clips(record: SourceRecord, reason: str) -> None:
    """text.video where the record names or places a clip and the family takes none."""
    placed = sum(turn.num_videos for turn in record.turns) if record.turns is not None else record.text.count(VIDEO)
    if record.videos or placed:
        raise CheckFailed("text.video", f"the record holds {max(len(record.videos), placed)} clip(s): {reason}",
                          expected="text and images", observed=f"{len(record.videos)} clip(s) named, {placed} placed")


def text_side(family, format: str, placeholder: str, missing_placeholder: str, text: TextConfig) -> TextSide:
    """The text side of a dataset format (ConfigError before any work where a conversation format's checkpoint has
    no chat template)."""
    renderer = ChatRenderer.of(family, text, format)
    return PlainText(family, placeholder, missing_placeholder, text.control_tokens) if renderer is None else Conversation(
        renderer, missing_placeholder)


def laid_out(side: TextSide, content: str | list[Turn], plans: list[ImagePlan], text: TextConfig,
             clip_plans: list = ()) -> TokenLayout:
    """The layout of a placed text, within text.max_tokens (text.too_long otherwise)."""
    layout = side.lay_out(content, plans, clip_plans)
    require_fits(layout, text.max_tokens, text.overflow == Overflow.drop_turns)
    return layout
