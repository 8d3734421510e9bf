"""A family from outside batchvlm, as a user writes one: MoonViT (the Kimi tower, resize rule and patch layout) with
Kimi-VL's prompt contract, which titles each image's frame `image` where K3 names its size. It states only that
difference; `model.family=framed_moonvit` finds it on the Python path, and conf/model/framed_moonvit.yaml is its YAML.
"""

from __future__ import annotations

import dataclasses

from batchvlm.families import ModelConfig
from batchvlm.families import kimi_k25
from batchvlm.format.schema import FRAME, IMAGE
from batchvlm.records import ImagePlan

write_tiny_checkpoint = kimi_k25.write_tiny_checkpoint


class FramedMoonViT(kimi_k25.KimiK25):
    name = "framed_moonvit"

    def expand_image(self, plan: ImagePlan) -> tuple[list[int], list[int]]:
        begin, content, end = self.frame_ids
        head = [begin] + self.encode_text("image") + [content]
        pads = [self.image_token_id] * plan.num_tokens
        return head + pads + [end], [FRAME] * len(head) + [IMAGE] * len(pads) + [FRAME]


def from_config(model: ModelConfig) -> FramedMoonViT:
    return kimi_k25.from_config(dataclasses.replace(model, framing="k3"), FramedMoonViT)  # its frame needs K3's tokens
