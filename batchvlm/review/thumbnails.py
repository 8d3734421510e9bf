"""Thumbnails of quarantined images, made as safely as the job decodes them.

Quarantined images are the ones most likely to be hostile, so a thumbnail is decoded with the run's
own decode limits (format allowlist, byte and pixel limits), read only from under the run's image
root as the job reads it, always in a forked child with a short time limit, and never at all for the
image that crashed or hung the job's decoder. An image that cannot be decoded that way gets a
placeholder saying why, never a partial picture.
"""

from __future__ import annotations

import base64
import dataclasses
import io
from dataclasses import dataclass, field

from PIL import Image

from batchvlm.checks import CheckFailed
from batchvlm.pipeline.decode import DecodeConfig
from batchvlm.pipeline.decode import Decoder
from batchvlm.records import ImageRef

THUMBNAIL_TIMEOUT_S = 10.0  # a reviewer waits seconds for a page, not the job's per-image limit
NEVER_DECODED = {"decode.crashed": "it crashed the decoder", "decode.timeout": "it hung the decoder",
                 "decode.path_outside_root": "its path is outside the image root"}


@dataclass
class Thumbnail:
    """One image of a card: a data URI, or why there is none, and what is known about the image."""

    data_uri: str | None
    reason: str = ""
    facts: dict[str, str] = field(default_factory=dict)


class Thumbnailer:
    def __init__(self, decode: DecodeConfig, planner=None, size: int = 192, root_of=lambda failure: None):
        timeout = min(decode.timeout_s, THUMBNAIL_TIMEOUT_S)
        self.limits = dataclasses.replace(decode, isolation="process", timeout_s=timeout)
        self.decoder = Decoder(self.limits)
        self.planner = planner  # (height, width) -> the family's ImagePlan, when the run's family loads
        self.size = size
        self.root_of = root_of  # a quarantine row -> the root its images' paths must lie under, as the job read them

    def __call__(self, data: bytes | None, path: str | None, index: int, failure: dict) -> Thumbnail:
        facts = {"bytes": f"{len(data):,}" if data is not None else "not kept"}
        if path:
            facts["path"] = path
        if failure["image_index"] == index and failure["check"] in NEVER_DECODED:
            return Thumbnail(None, f"not decoded: {NEVER_DECODED[failure['check']]} in the job", facts)
        if data is None and not path:
            return Thumbnail(None, "no bytes kept and no path", facts)
        try:
            image = self.decoder(ImageRef(data=data, path=path, root=self.root_of(failure)), index)
        except CheckFailed as refused:
            return Thumbnail(None, f"cannot be decoded safely: [{refused.check}] {refused.message}", facts)
        facts.update(format=image.format, size=f"{image.width}x{image.height}")
        facts.update(self._plan_facts(image.height, image.width))
        return Thumbnail(_data_uri(image.pixels, self.size), facts=facts)

    def _plan_facts(self, height: int, width: int) -> dict[str, str]:
        if self.planner is None:
            return {}
        try:
            plan = self.planner(height, width)
        except CheckFailed as refused:  # e.g. an aspect ratio the family refuses: that is the fact to show
            return {"plan": f"[{refused.check}] {refused.message}"}
        return {"resized": f"{plan.resized[1]}x{plan.resized[0]}", "grid_thw": "x".join(map(str, plan.grid_thw)),
                "tokens": str(plan.num_tokens)}

    def close(self) -> None:
        self.decoder.close()


def _data_uri(pixels, size: int) -> str:
    image = Image.fromarray(pixels)
    image.thumbnail((size, size))
    buffer = io.BytesIO()
    if image.mode == "RGBA":  # keep the transparency the reviewer may need to see
        image.save(buffer, format="PNG")
        kind = "png"
    else:
        image.save(buffer, format="JPEG", quality=85)
        kind = "jpeg"
    return f"data:image/{kind};base64,{base64.b64encode(buffer.getvalue()).decode()}"
