"""PackedSFTTrainer over real runs: TRL's loss against the model's, the logged token counts, eval and the documented
recipe, and the options it refuses."""

from __future__ import annotations

import pytest
import torch
from conftest import embed_in_process, run_training_doc_recipe
from hf_models import pretrained
from test_training_equivalence import trained_run
from transformers import AutoTokenizer, TrainingArguments

from batchvlm.families import tiny_checkpoint
from batchvlm.training import LoaderConfig, PackedLoader, load_run_dataset, pack
from batchvlm.training.model_inputs import model_inputs
from batchvlm.training.reader import read_run
from batchvlm.training.trainer import LOADER_STATE, PackedTrainer, RowCollator
from test_sft import trl  # first: the module is skipped where trl is missing (the dev extra installs it)
from batchvlm.training.sft import PackedSFTTrainer  # noqa: E402

# the job, then the full model and TRL's trainer
pytestmark = pytest.mark.slow


CONFIG = LoaderConfig(max_tokens=800, shuffle_buffer=4, pack_buffer=8, num_workers=0)


WIDE = LoaderConfig(max_tokens=4096, shuffle_buffer=4, pack_buffer=8, num_workers=0)  # Kimi's longest record: 1927


def sft_config(tmp_path, **overrides) -> trl.SFTConfig:
    settings = {"output_dir": str(tmp_path / "sft"), "use_cpu": True, "bf16": False, "remove_unused_columns": False,
                "activation_checkpointing": False, "report_to": [], "save_strategy": "no", "logging_steps": 1,
                "learning_rate": 1e-4, **overrides}
    return trl.SFTConfig(**settings)


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen3_vl", "kimi_k25"])
def family_run(request, tmp_path_factory):
    """A family's checkpoint (Qwen3-VL: with deepstack) and the job's run of 8 demo records through it."""
    return trained_run(request.param, tmp_path_factory.mktemp(request.param))


def trainer_for(checkpoint, run, tmp_path, trainer_class=PackedSFTTrainer, config=CONFIG, eval_dataset=None,
                **overrides):
    model = pretrained(checkpoint, dtype=torch.float32)
    return trainer_class(model, sft_config(tmp_path, **overrides), PackedLoader(run, config),
                         processing_class=AutoTokenizer.from_pretrained(checkpoint), eval_dataset=eval_dataset)


def test_one_steps_loss_through_trls_loss_is_the_models_loss_on_model_inputs(family_run, tmp_path):
    checkpoint, run = family_run
    first = next(iter(PackedLoader(run, WIDE)))
    fresh = pretrained(checkpoint, dtype=torch.float32)
    with torch.no_grad():
        expected = float(fresh(**model_inputs(fresh, first)).loss)  # item 1: the model's own loss
    trainer = trainer_for(checkpoint, run, tmp_path, config=WIDE, max_steps=1)
    trainer.model.eval()
    with torch.no_grad():  # TRL's loss (its fused LM head over the model's backbone) on the same batch
        trl_loss = float(trainer.compute_loss(trainer.model, trainer.batch_inputs(first)))
    assert trl_loss == pytest.approx(expected, rel=1e-5, abs=1e-6)
    trainer.model.train()
    trainer.train()
    logged = next(entry["loss"] for entry in trainer.state.log_history if "loss" in entry)
    assert logged == pytest.approx(expected, rel=1e-4)  # the Trainer logs the loss rounded
    assert trainer.loader.next_pack == 1  # one batch taken, nothing skipped or read ahead


def test_the_logged_num_tokens_is_the_number_of_tokens_the_packed_batches_hold(qwen_run, tmp_path):
    checkpoint, steps = tiny_checkpoint("qwen2_vl"), 3
    batches = iter(PackedLoader(qwen_run, CONFIG))
    lengths = [next(batches).num_tokens for _ in range(steps)]
    trainer = trainer_for(checkpoint, qwen_run, tmp_path, max_steps=steps)
    trainer.train()
    logged = [entry["num_tokens"] for entry in trainer.state.log_history if "num_tokens" in entry]
    assert logged == [sum(lengths[:step + 1]) for step in range(steps)]
    # What TRL itself adds for such a batch: position_ids.size(1) of [4, 1, L], one token a batch.
    first = next(iter(PackedLoader(qwen_run, CONFIG)))
    before = trainer._total_train_tokens
    trl.SFTTrainer.compute_loss(trainer, trainer.model, trainer.batch_inputs(first))
    assert trainer._total_train_tokens - before == 1 < first.num_tokens


class _WithoutLabels(PackedSFTTrainer):
    def batch_inputs(self, batch) -> dict:
        inputs = super().batch_inputs(batch)
        inputs.pop("labels")
        return inputs


def test_a_batch_without_labels_is_refused_before_trls_loss(qwen_run, tmp_path):
    trainer = trainer_for(tiny_checkpoint("qwen2_vl"), qwen_run, tmp_path, _WithoutLabels, max_steps=1)
    with pytest.raises(ValueError, match=r"without labels \(its keys: \['input_ids', 'mm_encoder_outputs', "
                                         r"'position_ids', 'use_cache'\]\)"):
        trainer.train()


def test_options_that_would_redo_what_the_loader_did_are_refused_by_name(qwen_run, tmp_path):
    checkpoint = tiny_checkpoint("qwen2_vl")
    with pytest.raises(ValueError, match="remove_unused_columns=True would drop") as dropped:
        trainer_for(checkpoint, qwen_run, tmp_path, remove_unused_columns=True)  # SFTConfig's default
    assert "'image_embeds'" in str(dropped.value)
    with pytest.raises(ValueError, match=r"packing=.*packed sequences already.*padding_free=.*assistant_only_loss="):
        trainer_for(checkpoint, qwen_run, tmp_path, packing=True, padding_free=True, assistant_only_loss=True)
    model, loader = pretrained(checkpoint, dtype=torch.float32), PackedLoader(qwen_run, CONFIG)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    with pytest.raises(TypeError, match="an SFTConfig"):
        PackedSFTTrainer(model, TrainingArguments(str(tmp_path / "t"), remove_unused_columns=False), loader,
                         processing_class=tokenizer)
    with pytest.raises(ValueError, match="data_collator.*override batch_inputs"):
        PackedSFTTrainer(model, sft_config(tmp_path), loader, processing_class=tokenizer,
                         data_collator=lambda rows: rows)


def test_the_stock_sft_trainer_over_the_runs_rows_with_the_row_collator_trains_and_counts_them(qwen_run, tmp_path):
    checkpoint = tiny_checkpoint("qwen2_vl")
    dataset = load_run_dataset(qwen_run, cache_dir=str(tmp_path / "cache")).select([0, 1])
    by_id = {record.id: record for record in read_run(qwen_run)}
    chosen = [by_id[record_id] for record_id in dataset["id"]]
    model = pretrained(checkpoint, dtype=torch.float32)
    with torch.no_grad():
        expected = float(model(**model_inputs(model, pack(chosen, 4096))).loss)
    skipped = {"skip_prepare_dataset": True}  # the rows are tokenized and labelled already
    trainer = trl.SFTTrainer(model, sft_config(tmp_path, max_steps=1, per_device_train_batch_size=2,
                                               dataset_kwargs=skipped),
                             train_dataset=dataset, data_collator=RowCollator(model, dataset, max_tokens=4096),
                             processing_class=AutoTokenizer.from_pretrained(checkpoint))
    trainer.train()
    (logged,) = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert logged["loss"] == pytest.approx(expected, rel=1e-4)
    assert logged["num_tokens"] == sum(len(record.input_ids) for record in chosen)  # a padded batch has a mask
    stripping = trl.SFTTrainer(model, sft_config(tmp_path, max_steps=1, remove_unused_columns=True,
                                                 dataset_kwargs=skipped),
                               train_dataset=dataset, data_collator=RowCollator(model, dataset, max_tokens=4096),
                               processing_class=AutoTokenizer.from_pretrained(checkpoint))
    with pytest.raises(ValueError, match=r"without the columns \['id', 'image_embeds'.*remove_unused_columns=False"):
        stripping.train()


def test_the_documented_trl_recipe_trains_on_the_run_and_checkpoints_the_loader(qwen_run, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the recipe writes checkpoints/ where it runs
    scope = run_training_doc_recipe("## Training with TRL", qwen_run)
    trainer = scope["trainer"]
    assert isinstance(trainer, PackedSFTTrainer)
    assert trainer.state.global_step == trainer.args.max_steps > 5
    assert (tmp_path / "checkpoints" / "checkpoint-5" / LOADER_STATE).exists()
    logged = [entry["num_tokens"] for entry in trainer.state.log_history if "num_tokens" in entry]
    assert logged and logged[-1] > trainer.state.global_step  # tokens, not batches


def test_clips_reach_the_model_through_trls_loss_and_through_the_row_collator(clip_run, tmp_path):
    """A clip run (output format 3): the packed loader's batch and the stock path's rows both give the model the
    stored clip tokens as mm_encoder_outputs["video"]; TRL's loss on them is the model's own, and a different one
    than with the clips left out (so they count). Rows whose clip columns were dropped are refused, naming them."""
    checkpoint = tiny_checkpoint("qwen2_vl")
    first = next(iter(PackedLoader(clip_run, WIDE)))
    by_id = {record.id: record for record in read_run(clip_run)}
    stored = [by_id[record_id] for record_id in first.ids]  # the pack's order
    assert first.video_embeds is not None and torch.equal(
        first.video_embeds, torch.cat([record.video_embeds for record in stored if record.video_embeds is not None]))
    trainer = trainer_for(checkpoint, clip_run, tmp_path, config=WIDE, max_steps=1)
    trainer.model.eval()
    inputs = trainer.batch_inputs(first)
    assert set(inputs["mm_encoder_outputs"]) == {"image", "video"}
    with torch.no_grad():
        expected = float(trainer.model(**model_inputs(trainer.model, first)).loss)
        trl_loss = float(trainer.compute_loss(trainer.model, inputs))
        del inputs["mm_encoder_outputs"]["video"]
        without = float(trainer.model(**inputs).loss)
    assert trl_loss == pytest.approx(expected, rel=1e-5, abs=1e-6) and abs(without - expected) > 1e-4

    dataset = load_run_dataset(clip_run, cache_dir=str(tmp_path / "cache"))
    collator = RowCollator(trainer.model, dataset, max_tokens=4096)
    batch = collator([dataset[i] for i in range(len(dataset))])
    clips = torch.cat([record.video_embeds for record in read_run(clip_run) if record.video_embeds is not None])
    assert torch.equal(torch.cat(batch["mm_encoder_outputs"]["video"].pooler_output), clips)
    stripped = dataset.remove_columns(["video_embeds", "video_spans"])
    with pytest.raises(ValueError, match=r"rows with clips reach the collator without the columns "
                                         r"\['video_embeds', 'video_spans'\]"):
        RowCollator(trainer.model, stripped, max_tokens=4096)([stripped[i] for i in range(len(stripped))])


# Evaluation: a stored eval run through a PackedLoader of its own.

@pytest.fixture(scope="module")
def eval_run(tmp_path_factory):
    """A run of its own to evaluate on (the job over the demo's first 4 records, through the same checkpoint)."""
    return embed_in_process(tmp_path_factory.mktemp("outputs"), "eval", "model=qwen2_vl_tiny", "dataset.limit=4")


EVAL = LoaderConfig(max_tokens=800, shuffle_buffer=4, pack_buffer=1, num_workers=0)  # a record a pack, in the
# epoch's shuffled order: each epoch's batches come in another order


def manual_eval_loss(model, run) -> float:
    """The low-level loop's loss over the eval loader's batches: each packed batch's loss (a mean over its trained
    tokens), averaged over the batches, as the Trainer's evaluation averages them."""
    model.eval()
    with torch.no_grad():
        losses = [float(model(**model_inputs(model, batch)).loss) for batch in PackedLoader(run, EVAL)]
    assert len(losses) >= 2
    return sum(losses) / len(losses)


class RecordingLoader(PackedLoader):
    """A PackedLoader noting the records of every batch it gives."""
    def __iter__(self):
        for batch in super().__iter__():
            self.taken.append(batch.ids)
            yield batch


@pytest.mark.parametrize("trainer_class", [PackedTrainer, PackedSFTTrainer])
def test_eval_loss_is_the_manual_loops_over_the_eval_loaders_batches_before_and_after_training(
        qwen_run, eval_run, tmp_path, trainer_class):
    checkpoint = tiny_checkpoint("qwen2_vl")
    expected = manual_eval_loss(pretrained(checkpoint, dtype=torch.float32), eval_run)
    epochs = PackedLoader(eval_run, EVAL)
    plan, second = [[batch.ids for batch in epochs] for _ in range(2)]
    assert plan != second  # a loader iterated again goes on to its next epoch
    evaluating = RecordingLoader(eval_run, EVAL)
    evaluating.taken = []
    trainer = trainer_for(checkpoint, qwen_run, tmp_path, trainer_class, max_steps=2, eval_dataset=evaluating,
                          eval_strategy="steps", eval_steps=1)
    assert trainer.evaluate()["eval_loss"] == pytest.approx(expected, rel=1e-5)
    assert evaluating.taken == plan
    assert trainer.loader.state_dict()["next_pack"] == 0  # evaluating took no training batch
    trainer.train()
    assert evaluating.taken == plan * 3  # every evaluation (one after each step) on the same batches
    evaluated = [entry["eval_loss"] for entry in trainer.state.log_history if "eval_loss" in entry]
    assert len(evaluated) == 2  # train() starts a log of its own
    assert trainer.loader.next_pack == 2  # the training loader gave its two batches, no more
    assert evaluated[-1] == pytest.approx(manual_eval_loss(trainer.model, eval_run), rel=1e-5)
    assert evaluated[-1] != pytest.approx(expected, rel=1e-5)  # the model trained in between


def test_an_eval_dataset_that_is_not_a_loader_of_its_own_is_refused(qwen_run, tmp_path):
    checkpoint = tiny_checkpoint("qwen2_vl")
    with pytest.raises(ValueError, match="eval_dataset: a PackedLoader over the eval run, got Dataset"):
        trainer_for(checkpoint, qwen_run, tmp_path, eval_dataset=load_run_dataset(qwen_run))
    model, loader = pretrained(checkpoint, dtype=torch.float32), PackedLoader(qwen_run, CONFIG)
    with pytest.raises(ValueError, match="eval_dataset is the training loader"):
        PackedTrainer(model, sft_config(tmp_path), loader, eval_dataset=loader)
