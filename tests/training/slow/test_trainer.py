"""PackedTrainer: HF Trainer on batchvlm's packed loader. In process: the refusals, max_steps from the plan, the first
step's loss that of model_inputs; under torchrun (2 ranks, gloo, CPU): every planned record once per epoch across the
ranks, and a run killed after a checkpoint resumes with the batches of a run never killed. RowCollator: the stock
Trainer over the run's `datasets` rows, its loss that of the packed batch; rows stripped of their columns refused."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_training_doc_recipe
from hf_models import pretrained
from transformers import TrainingArguments

from batchvlm.families import tiny_checkpoint
from batchvlm.training import LoaderConfig, PackedLoader, load_run_dataset, pack
from batchvlm.training.model_inputs import model_inputs
from batchvlm.training.reader import read_run
from batchvlm.training.trainer import LOADER_STATE, PackedTrainer, RowCollator

# the qwen_run fixture: the job in a subprocess
pytestmark = pytest.mark.slow

CONFIG = LoaderConfig(max_tokens=800, shuffle_buffer=4, pack_buffer=8, num_workers=0)
SCRIPT = Path(__file__).with_name("train_ranks.py")


def arguments(tmp_path, **overrides) -> TrainingArguments:
    settings = {"output_dir": str(tmp_path / "trainer"), "use_cpu": True, "remove_unused_columns": False,
                "report_to": [], "save_strategy": "no", "logging_steps": 1, "learning_rate": 1e-4, **overrides}
    return TrainingArguments(**settings)


@pytest.fixture(scope="module")
def model():
    return pretrained(tiny_checkpoint("qwen2_vl"), dtype=torch.float32)


def test_remove_unused_columns_is_refused_naming_the_columns_it_would_drop(qwen_run, tmp_path, model):
    with pytest.raises(ValueError, match="remove_unused_columns=True would drop") as refused:
        PackedTrainer(model, arguments(tmp_path, remove_unused_columns=True), PackedLoader(qwen_run, CONFIG))
    for column in ("image_embeds", "image_spans", "grid_thw", "token_tags"):
        assert repr(column) in str(refused.value)
    assert "'input_ids'" not in str(refused.value) and "'position_ids'" not in str(refused.value)


def test_max_steps_come_from_the_plans_of_the_epochs_and_more_are_refused(qwen_run, tmp_path, model):
    loader = PackedLoader(qwen_run, CONFIG)
    planned = [len(PackedLoader(qwen_run, CONFIG).epoch_packs())]
    second = PackedLoader(qwen_run, CONFIG)
    second.epoch = 1
    planned.append(len(second.epoch_packs()))
    trainer = PackedTrainer(model, arguments(tmp_path, num_train_epochs=2, gradient_accumulation_steps=2), loader)
    assert trainer.args.max_steps == -(-sum(planned) // 2)
    with pytest.raises(ValueError, match="max_steps=1000"):
        PackedTrainer(model, arguments(tmp_path, max_steps=1000), PackedLoader(qwen_run, CONFIG))
    with pytest.raises(ValueError, match="num_train_epochs=1.5"):
        PackedTrainer(model, arguments(tmp_path, num_train_epochs=1.5), PackedLoader(qwen_run, CONFIG))


def test_the_first_steps_loss_is_that_of_model_inputs_on_the_loaders_first_batch(qwen_run, tmp_path):
    fresh = pretrained(tiny_checkpoint("qwen2_vl"), dtype=torch.float32)
    first = next(iter(PackedLoader(qwen_run, CONFIG)))
    with torch.no_grad():
        expected = float(fresh(**model_inputs(fresh, first)).loss)
    trainer = PackedTrainer(fresh, arguments(tmp_path, max_steps=1), PackedLoader(qwen_run, CONFIG))
    trainer.train()
    logged = next(entry["loss"] for entry in trainer.state.log_history if "loss" in entry)
    assert logged == pytest.approx(expected, rel=1e-4)
    assert trainer.loader.next_pack == 1  # one batch taken: the Trainer skipped nothing and read nothing ahead


def test_resuming_from_a_checkpoint_without_the_loaders_state_is_refused(qwen_run, tmp_path, model):
    (tmp_path / "trainer" / "checkpoint-2").mkdir(parents=True)
    trainer = PackedTrainer(model, arguments(tmp_path), PackedLoader(qwen_run, CONFIG))
    with pytest.raises(ValueError, match=LOADER_STATE):
        trainer.train(resume_from_checkpoint=True)


def torchrun(run: Path, out: Path, *options: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
               str(SCRIPT), str(run), str(out), *options]
    return subprocess.run(command, capture_output=True, text=True, timeout=600)


def steps(out: Path, rank: int) -> list[str]:
    """The input_ids digests rank `rank` trained on, in step order."""
    lines = [json.loads(line) for line in (out / f"steps-{rank}.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, len(lines) + 1))
    return [line["input_ids"] for line in lines]


def digest(input_ids: torch.Tensor) -> str:
    return hashlib.sha256(input_ids.numpy(force=True).tobytes()).hexdigest()


def test_under_torchrun_each_epoch_trains_the_plan_once_and_a_killed_run_resumes_with_the_same_batches(qwen_run,
                                                                                                    tmp_path):
    # One run, killed after the checkpoint of step 4 and resumed: its steps, the first 4 before the kill and the rest
    # after the resume, are checked against the plan (from the loader alone), which is what a run never killed trains.
    killed = tmp_path / "killed"
    killed.mkdir()
    cut = torchrun(qwen_run, killed, "--exit-after-save", "4")
    assert cut.returncode != 0 and (killed / "trainer" / "checkpoint-4" / LOADER_STATE).exists()
    assert not (killed / "done-0.json").exists()
    # The plan, from the loader alone: pack g of an epoch is rank g % 2's; every pack's input_ids from read_run.
    by_id = {record.id: record for record in read_run(qwen_run)}
    planned = {rank: [] for rank in (0, 1)}
    packs_of: dict[str, list[str]] = {}
    per_epoch = []
    for epoch in (0, 1):
        plan = PackedLoader(qwen_run, CONFIG)
        plan.epoch = epoch
        names = [[by_id[i].id for i in ids] for ids in _plan_ids(plan)]
        per_epoch.append(names)
        for g, ids in enumerate(names[:len(names) // 2 * 2]):
            packed = digest(pack([by_id[i] for i in ids], CONFIG.max_tokens).input_ids)
            planned[g % 2].append(packed)
            packs_of[packed] = ids
    assert steps(killed, 0) == planned[0][:4]
    assert len(per_epoch[0]) // 2 < 4  # the run crossed into its second epoch before the kill, unbroken
    resumed = torchrun(qwen_run, killed, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for epoch, names in enumerate(per_epoch):
        trained = [i for rank in (0, 1) for packed in steps(killed, rank)[epoch * len(names) // 2:
                                                                          (epoch + 1) * (len(names) // 2)]
                   for i in packs_of[packed]]
        kept = [i for ids in names[:len(names) // 2 * 2] for i in ids]
        assert sorted(trained) == sorted(kept) and len(set(trained)) == len(trained), epoch  # once, none dropped
        assert len(kept) > 0.75 * len(by_id)  # only the tail of < 2 packs is left out of an epoch
    assert steps(killed, 0) == planned[0] and steps(killed, 1) == planned[1]
    done = json.loads((killed / "done-0.json").read_text())
    assert done["global_step"] == done["max_steps"] == len(planned[0])


def _plan_ids(loader: PackedLoader) -> list[list[str]]:
    import pyarrow.parquet as pq

    ids = [pq.read_table(path, columns=["id"]).column("id").to_pylist() for path in loader.index.shards]
    return [[ids[shard][row] for shard, row in refs] for refs in loader.epoch_packs()]


def test_the_stock_trainer_with_the_row_collator_trains_a_padded_batch_with_the_packed_loss(qwen_run, tmp_path):
    from transformers import Trainer

    dataset = load_run_dataset(qwen_run).select([0, 1])
    fresh = pretrained(tiny_checkpoint("qwen2_vl"), dtype=torch.float32)
    by_id = {record.id: record for record in read_run(qwen_run)}
    with torch.no_grad():
        expected = float(fresh(**model_inputs(fresh, pack([by_id[i] for i in dataset["id"]], 4096))).loss)
    trainer = Trainer(fresh, arguments(tmp_path, max_steps=1, per_device_train_batch_size=2), train_dataset=dataset,
                      data_collator=RowCollator(fresh, dataset, max_tokens=4096))
    trainer.train()
    logged = next(entry["loss"] for entry in trainer.state.log_history if "loss" in entry)
    assert logged == pytest.approx(expected, rel=1e-4)


def test_rows_whose_columns_the_trainer_removed_are_refused_naming_them(qwen_run, tmp_path, model):
    from transformers import Trainer

    dataset = load_run_dataset(qwen_run)
    trainer = Trainer(model, arguments(tmp_path, max_steps=1, remove_unused_columns=True), train_dataset=dataset,
                      data_collator=RowCollator(model, dataset, max_tokens=4096))
    with pytest.raises(ValueError, match=r"without the columns \['id', 'image_embeds', 'grid_thw', 'image_spans', "
                                         r"'token_tags'\].*remove_unused_columns=False"):
        trainer.train()


def test_the_documented_trainer_recipe_trains_on_the_run_and_checkpoints_the_loader(qwen_run, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the recipe writes checkpoints/ where it runs
    scope = run_training_doc_recipe("## Training with HF Trainer", qwen_run)
    trainer = scope["trainer"]
    assert trainer.state.global_step == trainer.args.max_steps > 5
    assert (tmp_path / "checkpoints" / "checkpoint-5" / LOADER_STATE).exists()


FLASH_KEYS = {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}


@pytest.mark.slow  # the job, then the full model
def test_under_flash_attention_the_trainer_hands_the_model_each_packs_record_bounds(qwen_run, tmp_path):
    model = pretrained(tiny_checkpoint("qwen2_vl"), dtype=torch.float32)
    trainer = PackedTrainer(model, arguments(tmp_path), PackedLoader(qwen_run, CONFIG))
    batch = next(iter(PackedLoader(qwen_run, CONFIG)))
    assert len(batch.ids) > 1
    assert not FLASH_KEYS & trainer.batch_inputs(batch).keys()  # sdpa: the mask comes from the positions
    # What from_pretrained(attn_implementation="flash_attention_2") sets; flash attention itself needs CUDA (the GPU
    # test of the packed logits under it is test_training_equivalence's).
    model.config.get_text_config()._attn_implementation = "flash_attention_2"
    inputs = trainer.batch_inputs(batch)
    assert inputs["cu_seq_lens_q"].dtype == inputs["cu_seq_lens_k"].dtype == torch.int32
    assert inputs["cu_seq_lens_q"].tolist() == inputs["cu_seq_lens_k"].tolist() == batch.cu_seqlens.tolist()
    assert inputs["max_length_q"] == inputs["max_length_k"] == max(torch.diff(batch.cu_seqlens).tolist())


@pytest.mark.slow  # the job, then the full model twice
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_eager_and_sdpa_attention_stay_within_each_packed_record(qwen_run, implementation):
    model = pretrained(tiny_checkpoint("qwen2_vl"), dtype=torch.float32, attn_implementation=implementation)
    batch = next(iter(PackedLoader(qwen_run, CONFIG)))
    records = {record.id: record for record in read_run(qwen_run)}
    with torch.no_grad():
        packed = model(**model_inputs(model, batch)).logits[0]
        for index, record_id in enumerate(batch.ids):
            alone = model(**model_inputs(model, pack([records[record_id]], CONFIG.max_tokens))).logits[0]
            start, end = batch.cu_seqlens[index:index + 2].tolist()
            assert (packed[start:end] - alone).abs().max() <= 1e-4 * alone.abs().max(), (implementation, record_id)
