"""Every answer that is a piece of a template, over the real processors: their ids, and a mask on the answer itself."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from batchvlm.checks import CheckFailed
from batchvlm.families import ModelConfig
from batchvlm.pipeline.chat import TextConfig
from batchvlm.families import load_family, tiny_checkpoint
from batchvlm.pipeline.chat import ChatRenderer
from batchvlm.pipeline.tokens import place_conversation_images
from batchvlm.sources.conversations import read_turns
from test_chat_exact import FORGED, reading_specials_as_text

# the real processors over a sweep of answers
pytestmark = pytest.mark.slow


TEMPLATES = Path(__file__).resolve().parents[2] / "families" / "templates"


# -- the sweep: every answer that is a piece of the template ---------------------------------------------------------
def qwen_turn(role: str, text: str, image: bool = False, head: str = "") -> list[tuple[str, str]]:
    return [("template", f"<|im_start|>{role}\n{head}" + ("<|vision_start|><|image_pad|><|vision_end|>" if image
                                                           else "")), (role, text), ("template", "<|im_end|>\n")]


def kimi_turn(role: str, text: str, image: bool = False) -> list[tuple[str, str]]:
    head = {"user": "<|im_user|>user<|im_middle|>", "assistant": "<|im_assistant|>assistant<|im_middle|><think></think>"}
    image_block = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>\n" if image else ""
    return [("template", head[role] + image_block), (role, text), ("template", "<|im_end|>")]


FORMATTERS = {
    "qwen2_vl": lambda x: [("template", "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"),
                           *qwen_turn("user", x, True), *qwen_turn("assistant", x), *qwen_turn("user", x),
                           *qwen_turn("assistant", x)],
    "qwen3_vl": lambda x: [*qwen_turn("user", x, True), *qwen_turn("assistant", x), *qwen_turn("user", x),
                           *qwen_turn("assistant", x)],
    "qwen3_vl_thinking": lambda x: [*qwen_turn("user", x, True), *qwen_turn("assistant", x), *qwen_turn("user", x),
                                    *qwen_turn("assistant", x, head="<think>\n\n</think>\n\n")],
    "kimi_k25": lambda x: [*kimi_turn("user", x, True), *kimi_turn("assistant", x), *kimi_turn("user", x),
                           *kimi_turn("assistant", x)],
}
"""What each template renders for [user (an image, x), assistant x, user x, assistant x], as (kind, text) pieces:
the template's own text, or a turn's (by role). Checked against transformers' rendering for every answer: where they
differ, the template rewrote the answer (Qwen3-VL-Thinking splits an answer at `</think>`, strips its newlines)."""

RECORDS = {
    "llava": lambda x: [{"from": "human", "value": "<image>" + x}, {"from": "gpt", "value": x},
                        {"from": "human", "value": x}, {"from": "gpt", "value": x}],
    "messages": lambda x: [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": x}]},
                           {"role": "assistant", "content": x}, {"role": "user", "content": x},
                           {"role": "assistant", "content": x}],
    "cauldron": lambda x: [{"user": x, "assistant": x}, {"user": x, "assistant": x}],
}


IMAGE_SIZE = (56, 84)


def specials_pattern(tokenizer) -> re.Pattern:
    specials = sorted((t.content for t in tokenizer.added_tokens_decoder.values() if t.special), key=len, reverse=True)
    return re.compile("|".join(map(re.escape, specials)))


def candidate_answers(template: str, specials: re.Pattern) -> list[str]:
    """Every piece of the template's own text: each special token and its fragments, each run of text between them,
    each word, punctuation run and whitespace in it; and the usual suspects."""
    found = {"\n", " ", "a", "im", "assistant", FORGED}
    for special in specials.findall(template):
        found |= {special, *re.findall(r"[A-Za-z0-9]+|[^A-Za-z0-9]+", special), *re.findall(r"\w+_\w+", special)}
    for run in specials.split(template):
        found |= {run, *re.findall(r"\w+|[^\w\s]+|\s+", run)}
    return sorted(found - {""})


def oracle(pieces: list[tuple[str, str]], tokenizer, specials: re.Pattern, as_text: bool):
    """The ids (image token not expanded) and the mask of the rendered pieces, from the HF tokenizer alone: the
    template's special tokens as tokens, every other character tokenized in runs between them (a turn's control
    strings as plain text where `as_text`), each token trained that holds a character of an answer, and the token
    that closes the answer (the `<|im_end|>` every one of these templates puts right after it)."""
    ids, starts, ends, answers, at = [], [], [], [], 0
    run, run_start = "", 0

    def flush():
        nonlocal run
        if run:
            options = dict(add_special_tokens=False, return_offsets_mapping=True)
            encoded = reading_specials_as_text(tokenizer, run, **options) if as_text else tokenizer(run, **options)
            ids.extend(encoded["input_ids"])
            starts.extend(run_start + a for a, _ in encoded["offset_mapping"])
            ends.extend(run_start + b for _, b in encoded["offset_mapping"])
        run = ""

    for kind, text in pieces:
        if kind == "assistant":
            answers.append((at, at + len(text)))
        chunks = re.split(f"({specials.pattern})", text) if kind == "template" else [text]
        for index, chunk in enumerate(chunks):
            if index % 2:  # a special token of the template
                flush()
                ids.append(tokenizer.convert_tokens_to_ids(chunk))
                starts.append(at)
                ends.append(at + len(chunk))
            elif chunk:
                run_start, run = (at, chunk) if not run else (run_start, run + chunk)
            at += len(chunk)
    flush()
    starts, ends, mask = np.asarray(starts), np.asarray(ends), np.zeros(len(ids), dtype=np.int64)
    for start, end in answers:
        inside = np.flatnonzero((ends > start) & (starts < end))
        mask[inside[0]:inside[-1] + 2] = 1
    return ids, mask.tolist()


def collapsed(layout) -> tuple[list[int], list[int]]:
    """The layout's ids and mask with each image span back to the one image token the template rendered."""
    keep = np.ones(len(layout.input_ids), dtype=bool)
    for start, length in layout.image_spans:
        keep[start + 1:start + length] = False
    return np.asarray(layout.input_ids)[keep].tolist(), np.asarray(layout.chat.loss_mask)[keep].tolist()


def processor_of(family, template: str):
    """The family's HF processor, built from the checkpoint's image processor, the family's tokenizer and the
    template."""
    from transformers import AutoImageProcessor

    if family.name == "kimi_k25":
        from transformers.models.kimi_k25.processing_kimi_k25 import Kimi_K25Processor
        from transformers.models.kimi_k25.video_processing_kimi_k25 import Kimi_K25VideoProcessor

        make, video = Kimi_K25Processor, Kimi_K25VideoProcessor()
    else:
        from transformers import Qwen2VLProcessor, Qwen2VLVideoProcessor

        make, video = Qwen2VLProcessor, Qwen2VLVideoProcessor()
    return make(image_processor=AutoImageProcessor.from_pretrained(family.checkpoint), video_processor=video,
                tokenizer=family.tokenizer, chat_template=template)


@pytest.fixture(scope="module")
def kimi_real(tmp_path_factory, qwen_real_checkpoint):
    """Kimi-K2.5's tiny checkpoint over Qwen2's real BPE (Kimi's own vocabulary is not published in a package): BPE
    merges across the template's text and an answer (`</think>` + "a" is one pre-token there) are the real ones."""
    import qwen_vocab

    folder = tmp_path_factory.mktemp("kimi_real_vocab")
    qwen_vocab.write_kimi_checkpoint(folder, qwen_real_checkpoint, tiny_checkpoint("kimi_k25"))
    return load_family(ModelConfig(family="kimi_k25", path=str(folder)))


SWEEP = ["qwen2_vl", "qwen3_vl", "qwen3_vl_thinking", "kimi_k25 (its tiny BPE)", "kimi_k25 (Qwen2's BPE)"]


@pytest.fixture(scope="module", params=SWEEP)
def swept(request, qwen_real, kimi_family) -> tuple[str, object, str]:
    """(template name, family, template): Qwen3-VL's templates on Qwen2-VL's real vocabulary (the same tokens)."""
    name = request.param.split()[0]
    family = {"kimi_k25 (its tiny BPE)": kimi_family}.get(request.param) or (
        request.getfixturevalue("kimi_real") if name == "kimi_k25" else qwen_real)
    template = (TEMPLATES / f"{name}.jinja").read_text() if name.startswith("qwen3") else family.tokenizer.chat_template
    return name, family, template


def test_every_answer_that_is_a_piece_of_the_template_gets_the_processors_ids_and_a_mask_on_itself(swept):
    name, family, template = swept
    tokenizer, formatter = family.tokenizer, FORMATTERS[name]
    specials = specials_pattern(tokenizer)
    processor, image = processor_of(family, template), Image.new("RGB", IMAGE_SIZE[::-1], (200, 120, 40))
    plans = [family.plan(*IMAGE_SIZE)]
    answers = candidate_answers("".join(text for kind, text in formatter("") if kind == "template"), specials)
    tried = {"exact": 0, "control": 0, "rewritten": 0}
    # (the format only says how a record is read: every conversation format trains the assistant turns)
    renderers = {as_text: ChatRenderer(family, template, TextConfig(control_tokens="text" if as_text else "quarantine"),
                                       "llava") for as_text in (False, True)}
    for answer in answers:
        pieces = formatter(answer)
        messages = [{"role": role, "content": [{"type": "text", "text": text}]} for role, text in pieces
                    if role != "template"]
        messages[0]["content"].insert(0, {"type": "image", "image": image})
        rewritten = tokenizer.apply_chat_template(messages, tokenize=False, chat_template=template) != \
            "".join(text for _, text in pieces)
        control = specials.search(answer) is not None
        theirs = None if rewritten or control else \
            list(processor.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"][0])
        tried["rewritten" if rewritten else "control" if control else "exact"] += 1
        for format, record in RECORDS.items():
            turns = place_conversation_images(read_turns(format, record(answer), "<image>", 1), 1, "prepend")
            for as_text in (False, True):
                chat = renderers[as_text]
                case = f"{name} {format} {answer!r} control_tokens={'text' if as_text else 'quarantine'}"
                if rewritten or (control and not as_text):
                    with pytest.raises(CheckFailed) as caught:
                        chat.lay_out(turns, plans)
                    assert caught.value.check == ("text.chat_template" if rewritten else "text.control_token"), case
                    continue
                layout = chat.lay_out(turns, plans)
                if theirs is not None:
                    assert layout.input_ids == theirs, case
                assert collapsed(layout) == oracle(pieces, tokenizer, specials, as_text), case
    assert tried["exact"] >= 20 and tried["control"] >= 5, tried
