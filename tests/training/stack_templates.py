"""LLaMA-Factory's and ms-swift's Qwen2-VL templates, written again from their published sources for the export's
oracle: neither stack installs beside this project's transformers (LLaMA-Factory 0.9.5 pins transformers 5.6.0 and
datasets 4.0.0, ms-swift 4.6.0 transformers 5.19.0 and datasets 4.8.4: `pip install --dry-run` would downgrade them),
so their rules are implemented here, in the tests only, as each stack applies them to a `messages`/`images` record.
Each function takes the record as the exporter wrote it and returns the stack's (input_ids, labels), -100 where the
stack does not train.

LLaMA-Factory, hiyouga/LLaMA-Factory @ ff6d4d12eeb035d6ce06805a5733dd7b29f2ac30:
- data/converter.py, SharegptDatasetConverter: a first message whose role is the system tag becomes the system
  prompt; the rest alternate user / assistant.
- data/template.py, register_template(name="qwen2_vl"): format_system "<|im_start|>system\\n{{content}}<|im_end|>\\n",
  format_user "<|im_start|>user\\n{{content}}<|im_end|>\\n<|im_start|>assistant\\n", format_assistant
  "{{content}}<|im_end|>\\n", default_system "You are a helpful assistant.", efficient_eos off.
  Template._encode: `system = system or self.default_system`; the system slot goes before the first user turn; each
  slot string is encoded apart (`tokenizer.encode(elem, add_special_tokens=False)`).
- data/mm_plugin.py, Qwen2VLPlugin.process_messages: each `<image>` of a message, in order, becomes
  "<|vision_start|>" + "<|image_pad|>" * (prod(image_grid_thw[i]) // merge_size**2) + "<|vision_end|>" before
  tokenization; _validate_messages raises when `<image>` count != len(images).
- data/processor/supervised.py, _encode_data_example: per (user, assistant) pair, labels = [-100] * len(source) +
  target (train_on_prompt and mask_history off, their defaults): every answer, its <|im_end|> and the "\\n" after it
  are trained; the system prompt, the user turns, the image tokens and the assistant header are not.

ms-swift, modelscope/ms-swift @ 3602360a562313afbf2ef6065fdf61f271a2c5b9:
- template/templates/utils.py, ChatmlTemplateMeta: system_prefix "<|im_start|>system\\n{{SYSTEM}}<|im_end|>\\n",
  prompt "<|im_start|>user\\n{{QUERY}}<|im_end|>\\n<|im_start|>assistant\\n", chat_sep "<|im_end|>\\n", suffix
  "<|im_end|>\\n"; templates/qwen.py, QwenTemplateMeta: default_system "You are a helpful assistant.", no BOS;
  Qwen2VLTemplate: `<image>` -> "<|vision_start|><|image_pad|><|vision_end|>", each <|image_pad|> then extended to
  prod(image_grid_thw[i]) // merge_size**2 tokens (labels -100).
- template/template_inputs.py: a first `system` message is the system prompt (None: the default one).
- template/base.py, Template._swift_encode: prefix, then per round the prompt, the response (ContextType.RESPONSE),
  then chat_sep (OTHER) between rounds or suffix (SUFFIX) after the last; _split_special_tokens cuts out `<image>`,
  _pre_tokenize_images gives it loss 0; _simplify_context_list joins neighbouring strings of equal loss scale, each
  join tokenized apart (`add_special_tokens=False`); _encode_context_list: labels where the loss scale > 0;
  _add_dynamic_eos labels the suffix's tokens where an untrained gap after a trained run begins with them (the
  chat_sep after every answer); labels[0] = -100.
- loss_scale/base.py, LossScale with base_strategy 'default' (arguments' loss_scale default): RESPONSE and SUFFIX
  contexts are trained, the rest not.
"""

from __future__ import annotations

import math

IGNORE = -100
IMAGE_TAG = "<image>"
MEDIA_TAGS = ("<image>", "<video>", "<audio>")
DEFAULT_SYSTEM = "You are a helpful assistant."
MERGE_LENGTH = 4  # Qwen2-VL's image processor: merge_size 2


def image_run(grid) -> str:
    return "<|vision_start|>" + "<|image_pad|>" * (math.prod(grid) // MERGE_LENGTH) + "<|vision_end|>"


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False) if text else []


def llamafactory_qwen2_vl(tokenizer, record: dict, grids: list) -> tuple[list[int], list[int]]:
    messages = [dict(message) for message in record["messages"]]
    system = messages.pop(0)["content"] if messages and messages[0]["role"] == "system" else ""
    placeholders = sum(message["content"].count(IMAGE_TAG) for message in messages)
    if placeholders != len(grids):
        raise ValueError(f"The number of images does not match the number of {IMAGE_TAG} tokens")
    images = iter(grids)
    for message in messages:
        while IMAGE_TAG in message["content"]:
            message["content"] = message["content"].replace(IMAGE_TAG, image_run(next(images)), 1)
    system = system or DEFAULT_SYSTEM
    encoded = []
    for index, message in enumerate(messages):
        elements = [f"<|im_start|>system\n{system}<|im_end|>\n"] if index == 0 else []
        if message["role"] == "user":
            elements.append(f"<|im_start|>user\n{message['content']}<|im_end|>\n<|im_start|>assistant\n")
        else:
            elements.append(f"{message['content']}<|im_end|>\n")
        encoded.append([token for element in elements for token in encode(tokenizer, element)])
    input_ids, labels = [], []
    for source, target in zip(encoded[::2], encoded[1::2]):
        input_ids += source + target
        labels += [IGNORE] * len(source) + target
    return input_ids, labels


def swift_qwen2_vl(tokenizer, record: dict, grids: list) -> tuple[list[int], list[int]]:
    messages = list(record["messages"])
    system = messages.pop(0)["content"] if messages and messages[0]["role"] == "system" else None
    system = DEFAULT_SYSTEM if system is None else system
    contexts: list[tuple[str, float]] = []  # (text, loss scale)
    if system:
        contexts.append((f"<|im_start|>system\n{system}<|im_end|>\n", 0.0))
    rounds = list(zip(messages[::2], messages[1::2]))
    for index, (query, response) in enumerate(rounds):
        contexts.append((f"<|im_start|>user\n{query['content']}<|im_end|>\n<|im_start|>assistant\n", 0.0))
        contexts.append((response["content"], 1.0))
        contexts.append(("<|im_end|>\n", 0.0 if index < len(rounds) - 1 else 1.0))
    # _split_special_tokens + _pre_tokenize_images: each <image> its own context, loss 0
    pieces: list[tuple[str, float]] = []
    for text, scale in contexts:
        for part in split_on_tags(text):
            if part == IMAGE_TAG:
                pieces.append(("<|vision_start|><|image_pad|><|vision_end|>", 0.0))
            elif part:
                pieces.append((part, scale))
    # _simplify_context_list: neighbouring strings of one loss scale joined, then tokenized
    joined: list[tuple[str, float]] = []
    for text, scale in pieces:
        if joined and joined[-1][1] == scale:
            joined[-1] = (joined[-1][0] + text, scale)
        else:
            joined.append((text, scale))
    input_ids, labels = [], []
    for text, scale in joined:
        ids = encode(tokenizer, text)
        input_ids += ids
        labels += ids if scale > 0 else [IGNORE] * len(ids)
    add_dynamic_eos(input_ids, labels, encode(tokenizer, "<|im_end|>\n"))
    labels[0] = IGNORE
    return extend_images(tokenizer, input_ids, labels, grids)


def split_on_tags(text: str) -> list[str]:
    """ms-swift's split_str_parts_by on its special tokens: the text with each media tag a part of its own."""
    parts, at = [], 0
    while True:
        found = [(text.find(tag, at), tag) for tag in MEDIA_TAGS if text.find(tag, at) >= 0]
        if not found:
            return parts + [text[at:]]
        start, tag = min(found)
        parts += [text[at:start], tag]
        at = start + len(tag)


def add_dynamic_eos(input_ids: list[int], labels: list[int], suffix: list[int]) -> None:
    """ms-swift's Template._add_dynamic_eos."""
    start = 0
    for i in range(1, len(labels) + 1):
        if labels[i - 1] >= 0 and i < len(labels) and labels[i] == IGNORE:
            start = i
        elif start > 0 and labels[i - 1] == IGNORE and (i == len(labels) or labels[i] >= 0):
            if i - start >= len(suffix) and input_ids[start:start + len(suffix)] == suffix:
                labels[start:start + len(suffix)] = suffix


def extend_images(tokenizer, input_ids: list[int], labels: list[int], grids: list) -> tuple[list[int], list[int]]:
    """Qwen2VLTemplate._encode: each <|image_pad|> extended to its image's tokens, none of them trained."""
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    images = iter(grids)
    ids, out_labels = [], []
    for token, label in zip(input_ids, labels):
        count = math.prod(next(images)) // MERGE_LENGTH if token == pad else 1
        ids += [token] * count
        out_labels += [IGNORE] * count if token == pad else [label]
    return ids, out_labels
