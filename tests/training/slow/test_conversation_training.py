"""Training on conversations: the job on LLaVA records (Qwen2-VL's real vocabulary), then the loader's packed batches.

The oracle: in a packed batch, every record's per-token losses equal that record's own per-token losses from the
full HF model run on its raw images through transformers' Qwen2VLProcessor, with assistant-only labels derived from
the turns' markers (the Qwen finetune scripts' rule), not from the stored mask.
"""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
import torch
from conftest import LLAVA_MAX_TOKENS, committed_shards, quarantine_rows
from PIL import Image

from batchvlm.pipeline.decode import DecodeConfig
from batchvlm.format.schema import IMAGE
from batchvlm.pipeline.decode import decode_image
from batchvlm.training import LoaderConfig, PackedLoader
from batchvlm.training.interop import DatasetRows, load_run_dataset
from batchvlm.training.packing import IGNORE_INDEX
from batchvlm.training.reader import read_run

pytestmark = pytest.mark.slow  # the job, then the full model


def stored_rows(run_dir) -> dict[str, dict]:
    return {row["id"]: row for shard in committed_shards(run_dir) for row in pq.read_table(shard).to_pylist()}


def messages_of(row: dict, dataset) -> list[dict]:
    """The record's kept turns as transformers' messages, each image decoded as the job decoded it."""
    turns = json.loads(row["text"])[:len(row["turns"])]
    images = iter(Image.fromarray(decode_image((dataset.parent / "img" / name).read_bytes(), DecodeConfig()).pixels)
                  for name in IMAGES[row["id"]])
    messages = []
    for turn in turns:
        pieces = turn["content"].split("<image>")
        content = [{"type": "text", "text": pieces[0]}] if pieces[0] else []
        for piece in pieces[1:]:
            content += [{"type": "image", "image": next(images)}] + ([{"type": "text", "text": piece}] if piece else [])
        messages.append({"role": turn["role"], "content": content})
    return messages


IMAGES = {"two_photos": ["cat.png", "coffee.jpg"], "text_only": [], "long": ["rocket.jpg"]}


def processor_of(checkpoint):
    from transformers import AutoTokenizer, Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    return Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor.from_pretrained(checkpoint),
                            video_processor=Qwen2VLVideoProcessor(), tokenizer=tokenizer,
                            chat_template=tokenizer.chat_template)


def marker_labels(ids: torch.Tensor, tokenizer) -> torch.Tensor:
    """Assistant-only labels by the Qwen finetune scripts' rule: after each `<|im_start|>assistant\\n` through the
    next `<|im_end|>`."""
    start, end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    header = [start, *tokenizer.encode("assistant\n")]
    values, labels = ids.tolist(), torch.full_like(ids, IGNORE_INDEX)
    for i in range(len(values) - len(header)):
        if values[i:i + len(header)] == header:
            stop = values.index(end, i + len(header))
            labels[i + len(header):stop + 1] = ids[i + len(header):stop + 1]
    return labels


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy as transformers' loss computes it (logits at t predict the label at t + 1); 0 where
    the label is ignored."""
    return torch.nn.functional.cross_entropy(logits[:-1], labels[1:], ignore_index=IGNORE_INDEX, reduction="none")


def test_the_job_writes_conversations_with_their_turns_and_quarantines_bad_roles(llava_run, llava_dataset,
                                                                                 qwen_real_checkpoint):
    rows = stored_rows(llava_run)
    assert set(rows) == {"two_photos", "text_only", "long"}
    assert [(q["id"], q["check"]) for q in quarantine_rows(llava_run)] == [("answer_first", "text.roles")]
    long = rows["long"]
    assert long["dropped_turns"] > 0 and len(long["turns"]) == 6 - long["dropped_turns"]
    assert long["num_tokens"] == len(long["input_ids"]) <= LLAVA_MAX_TOKENS
    assert long["turns"][-1]["role"] == "assistant" and len(long["grid_thw"]) == 1
    # Token for token the processor's ids of the same turns and images: also those of a conversation cut short.
    processor = processor_of(qwen_real_checkpoint)
    for record_id, row in rows.items():
        theirs = processor.apply_chat_template(messages_of(row, llava_dataset), tokenize=True, return_dict=True)
        assert row["input_ids"] == list(theirs["input_ids"][0]), record_id


def test_packed_losses_equal_each_records_own_losses_from_the_full_model_on_its_raw_images(llava_run, llava_dataset,
                                                                                             qwen_real_checkpoint):
    from transformers import Qwen2VLForConditionalGeneration

    model = Qwen2VLForConditionalGeneration.from_pretrained(qwen_real_checkpoint, dtype=torch.float32).eval()
    processor = processor_of(qwen_real_checkpoint)
    rows = stored_rows(llava_run)
    loader = PackedLoader(llava_run, LoaderConfig(max_tokens=2048, shuffle_buffer=1, num_workers=0))
    batches = list(loader)
    assert max(len(batch.ids) for batch in batches) >= 2  # records share a pack
    compared = 0
    with torch.inference_mode():
        for batch in batches:
            embeds = model.get_input_embeddings()(batch.input_ids)
            embeds[0, batch.image_positions] = batch.image_embeds.to(embeds.dtype)
            logits = model(inputs_embeds=embeds, position_ids=batch.position_ids, use_cache=False).logits[0]
            packed = token_losses(logits, batch.labels[0])
            cu = batch.cu_seqlens.tolist()
            for k, record_id in enumerate(batch.ids):
                inputs = processor.apply_chat_template(messages_of(rows[record_id], llava_dataset), tokenize=True,
                                                       return_dict=True, return_tensors="pt")
                labels = marker_labels(inputs["input_ids"][0], processor.tokenizer)
                # The loader's labels are the stored mask's (its first token aside): the markers' rule.
                assert torch.equal(batch.labels[0, cu[k] + 1:cu[k + 1]], labels[1:]), record_id
                alone = token_losses(model(**inputs, use_cache=False).logits[0], labels)
                ours = packed[cu[k]:cu[k + 1] - 1]
                trained = labels[1:] != IGNORE_INDEX
                assert trained.sum() > 0
                assert torch.allclose(ours[trained], alone[trained], rtol=1e-4, atol=1e-4), record_id
                compared += 1
    assert compared == 3


def test_datasets_rows_carry_the_same_loss_mask_as_read_run(llava_run):
    rows = DatasetRows.from_dataset(dataset := load_run_dataset(llava_run))
    by_id = {record.id: record for record in read_run(llava_run)}
    assert len(dataset) == 3
    for row in dataset:
        ours = by_id[row["id"]]
        assert torch.equal(rows.tensors(row).loss_mask, ours.loss_mask) and ours.loss_mask.sum() > 0
        assert not (ours.loss_mask.bool() & (ours.token_tags == IMAGE)).any()
