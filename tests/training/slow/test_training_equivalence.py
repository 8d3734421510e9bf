"""The oracle of packing: the model fed one packed batch of several records gives, for each record, the logits of
that record fed alone (fp32, within 1e-4 of scale), per family; the same batch with positions that do not
restart per record lets the records attend to one another and is caught by the same comparison."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, all_families, embed_in_process
from hf_models import pretrained
from transformers import AutoConfig, AutoModelForImageTextToText
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

from batchvlm.families import ModelConfig
from batchvlm.families import load_family, tiny_checkpoint
from batchvlm.training import PackedBatch, pack
from batchvlm.training.reader import read_run

sys.path.insert(0, str(REPO / "tests" / "families"))
from test_qwen2_vl import _tiny_variant, qwen3_config  # noqa: E402  (the Qwen3-VL checkpoint those tests build)

# the job per family, then the full models
pytestmark = pytest.mark.slow

MAX_TOKENS = 4096


def qwen3_checkpoint(folder: Path) -> Path:
    qwen = load_family(ModelConfig(family="qwen2_vl"))
    _tiny_variant(folder, qwen, qwen3_config(qwen))
    return folder


CHECKPOINTS = {**{name: lambda _, name=name: tiny_checkpoint(name) for name in all_families()},
               "qwen3_vl": qwen3_checkpoint}
"""Every family's tiny checkpoint, and Qwen3-VL's (deepstack), which the qwen2_vl family reads too."""
FAMILY_OF = {"qwen3_vl": "qwen2_vl"}


def logits(model, batch: PackedBatch, position_ids: torch.Tensor, **attention) -> torch.Tensor:
    """The forward a trainer runs on a packed batch: no attention mask and no cache, so that transformers
    builds the block-causal mask from the restarting text positions."""
    if batch.deepstack_embeds is not None:  # Qwen3-VL: merger tokens and deepstack layers as the encoder's output
        stored = BaseModelOutputWithDeepstackFeatures(pooler_output=(batch.image_embeds,),
                                                      deepstack_features=[(layer,) for layer in batch.deepstack_embeds])
        return model(input_ids=batch.input_ids, position_ids=position_ids, mm_encoder_outputs={"image": stored},
                     use_cache=False, **attention).logits[0]
    embeds = model.get_input_embeddings()(batch.input_ids)
    embeds[0, batch.image_positions] = batch.image_embeds.to(embeds.dtype)
    return model(inputs_embeds=embeds, position_ids=position_ids, use_cache=False, **attention).logits[0]


def not_restarted(batch: PackedBatch) -> torch.Tensor:
    """The trap: the records' positions concatenated as they are stored, the text row counting on across records."""
    positions = batch.position_ids.clone()
    positions.reshape(-1, batch.num_tokens)[0] = torch.arange(batch.num_tokens)
    return positions


def trained_run(name: str, root: Path, *overrides: str) -> tuple[Path, Path]:
    """One of CHECKPOINTS under `root` and the job's fp32 run of 8 demo records through it (a checkpoint with no
    language model to train is skipped): the checkpoint and the run directory."""
    checkpoint = CHECKPOINTS[name](root / "checkpoint")
    model_type = AutoConfig.from_pretrained(checkpoint).model_type
    if model_type not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        pytest.skip(f"{name}: its checkpoint ({model_type}) has no language model to train")
    run = embed_in_process(root, "train", f"model.family={FAMILY_OF.get(name, name)}", f"model.path={checkpoint}",
                           "output.embed_dtype=float32", "dataset.limit=8", *overrides)
    return checkpoint, run


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def family_run(request, tmp_path_factory):
    checkpoint, run = trained_run(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, AutoModelForImageTextToText, checkpoint, list(read_run(run))


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_batch_gives_each_record_its_own_logits(family_run, attention):
    name, model_class, checkpoint, records = family_run
    model = pretrained(checkpoint, model_class, dtype=torch.float32, attn_implementation=attention)
    chosen = [r for r in records if len(r.grid_thw)][:3] + [r for r in records if not len(r.grid_thw)][:1]
    batch = pack(chosen, MAX_TOKENS)
    assert len(batch.ids) >= 3 and (batch.deepstack_embeds is not None) == (name == "qwen3_vl")
    with torch.inference_mode():
        packed, leaky = logits(model, batch, batch.position_ids), logits(model, batch, not_restarted(batch))
        errors, leaks = [], []
        for record, start, stop in zip(chosen, batch.cu_seqlens[:-1].tolist(), batch.cu_seqlens[1:].tolist()):
            alone_batch = pack([record], MAX_TOKENS)
            alone = logits(model, alone_batch, alone_batch.position_ids)
            scale = alone.abs().max()
            errors.append(float((packed[start:stop] - alone).abs().max() / scale))
            leaks.append(float((leaky[start:stop] - alone).abs().max() / scale))
    assert max(errors) <= 1e-4, (name, errors)
    # The first record attends to nothing before it either way; every later one sees the others unless restarted.
    assert min(leaks[1:]) > 1e-2, (name, leaks)


@pytest.mark.skipif(not (torch.cuda.is_available() and importlib.util.find_spec("flash_attn")),
                    reason="flash_attention_2 needs CUDA and the flash_attn package")
def test_packed_batch_under_flash_attention_gives_each_record_its_own_logits(family_run):
    """The GPU path: varlen flash-attention from the batch's cu_seqlens (bf16, so a looser bound than fp32)."""
    name, model_class, checkpoint, records = family_run
    model = pretrained(checkpoint, model_class, dtype=torch.bfloat16, attn_implementation="flash_attention_2").cuda()
    chosen = [r for r in records if len(r.grid_thw)][:3]
    batch = pack(chosen, MAX_TOKENS).to("cuda")
    with torch.inference_mode():
        packed = logits(model, batch, batch.position_ids, **batch.flash_attn_kwargs()).float()
        for record, start, stop in zip(chosen, batch.cu_seqlens[:-1].tolist(), batch.cu_seqlens[1:].tolist()):
            alone_batch = pack([record], MAX_TOKENS).to("cuda")
            alone = logits(model, alone_batch, alone_batch.position_ids).float()
            assert (packed[start:stop] - alone).abs().max() <= 2e-2 * alone.abs().max(), (name, record.id)
