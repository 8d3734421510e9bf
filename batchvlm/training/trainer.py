"""HF `Trainer` on the packed loader: batchvlm's loader stays the loader, and its state rides in the checkpoints.

What the stock Trainer would do to stored features, and what this one does instead:
- `remove_unused_columns=True` (its default) drops every column `forward` does not name: the embeddings and spans,
  and training runs on text alone without a word. Refused, naming the columns.
- accelerate re-shards or dispatches a loader it prepares; `PackedLoader` already deals its packs over the ranks
  (every rank the same number of batches), so it is never handed to accelerate.
- On resume the Trainer skips the batches it already took, reading them again; the loader's state, saved in every
  checkpoint, puts it where it stopped instead.
- The loader has an epoch's plan, not a length the Trainer can read: `max_steps` comes from the plans of
  `num_train_epochs` epochs (each epoch packs its own shuffle, so their batch counts may differ).
- Attention stays within each packed record under every implementation (transformers 5 builds the mask per record
  from the restarted text positions when there is no attention mask and no cache; flash attention finds the records
  in them too). Under flash attention the batch's own record bounds go in as well (`cu_seq_lens_*`, `max_length_*`),
  which it would otherwise derive from the positions again in every layer, with a device sync each time.
- An `eval_dataset` would be collated by the Trainer's collator, which knows no stored features: the eval data is a
  second PackedLoader, over the eval run, passed as `eval_dataset`; every evaluation is one pass over its first
  epoch (the same batches each time), this rank's share of its packs, never handed to accelerate either.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pyarrow.parquet as pq
from transformers import Trainer, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint
from transformers.utils.generic import is_flash_attention_requested

from batchvlm.format.schema import VIDEO
from batchvlm.training.interop import DatasetRows
from batchvlm.training.loader import PackedLoader
from batchvlm.training.model_inputs import forward_parameters, model_inputs, pad, takes_encoder_outputs

LOADER_STATE = "batchvlm_loader.json"
"""The loader's state_dict, in each checkpoint folder beside the Trainer's own files."""

_LABEL_COLUMNS = {"label", "label_ids", "labels"}  # what the Trainer keeps beside forward's parameters


def dropped_columns(model, args: TrainingArguments, loader: PackedLoader) -> list[str]:
    """The run's columns that `remove_unused_columns=True` would drop: those `model.forward` does not name."""
    names = pq.read_schema(loader.index.shards[0]).names if loader.index.shards else []
    return sorted(set(names) - forward_parameters(model) - _LABEL_COLUMNS - set(args.label_names or []))


def training_epochs(args: TrainingArguments) -> int:
    epochs = args.num_train_epochs
    if epochs < 1 or epochs != int(epochs):
        raise ValueError(f"num_train_epochs={epochs}: the loader's epochs are whole passes over the run; give a whole "
                         "number of them (and max_steps to stop earlier)")
    return int(epochs)


class _TrainingBatches:
    """This rank's batches of the whole training, the loader's epochs one after the other, as the model's inputs.

    One pass over it is all of training: to the Trainer it is a single epoch of `len()` batches, so that the
    loader's epochs, of different lengths, need not fit the Trainer's idea of an epoch."""

    def __init__(self, trainer: PackedTrainer):
        self.trainer = trainer

    def __len__(self) -> int:
        return self.trainer.planned_batches

    def __iter__(self):
        trainer = self.trainer
        while trainer.loader.epoch < trainer.epochs:
            for batch in trainer.loader:
                yield trainer.batch_inputs(batch.to(trainer.args.device))


class _EvalBatches:
    """One pass over the eval loader's first epoch, as the model's inputs: the same batches at every evaluation (the
    plan is seeded), this rank's share of them (the loader deals its packs over the ranks itself)."""

    def __init__(self, trainer: PackedTrainer, loader: PackedLoader):
        self.trainer, self.loader = trainer, loader

    def __len__(self) -> int:
        self.loader.rewind()  # a pass left it at its next epoch, whose packs would be planned to count them
        return len(self.loader)

    def __iter__(self):
        self.loader.rewind()
        for batch in self.loader:
            yield self.trainer.batch_inputs(batch.to(self.trainer.args.device))


def eval_loader_of(eval_dataset, loader: PackedLoader) -> PackedLoader | None:
    """The eval run's loader, given as `eval_dataset`, checked: a PackedLoader, and not the training one."""
    if eval_dataset is None:
        return None
    if not isinstance(eval_dataset, PackedLoader):
        raise ValueError(f"eval_dataset: a PackedLoader over the eval run, got {type(eval_dataset).__name__}; the "
                         "Trainer's collator would batch its rows without their stored features")
    if eval_dataset is loader:
        raise ValueError("eval_dataset is the training loader: evaluating would take the training batches; pass a "
                         "PackedLoader of its own over the eval run")
    return eval_dataset


class PackedTrainer(Trainer):
    """`Trainer(model, args, ...)` training on `loader` (a PackedLoader over a run) for `args.num_train_epochs`
    loader epochs; every other Trainer argument but a training dataset works as usual. `eval_dataset` is a
    PackedLoader of its own over the eval run."""

    def __init__(self, model, args: TrainingArguments, loader: PackedLoader, **kwargs):
        self.take_loader(model, args, loader, kwargs)
        super().__init__(model=model, args=args, **kwargs)

    def take_loader(self, model, args: TrainingArguments, loader: PackedLoader, kwargs: dict) -> None:
        """The loader as the training data, checked against the arguments before any work; `max_steps` from its plan."""
        if kwargs.get("train_dataset") is not None:
            raise ValueError("train_dataset: the PackedLoader is the training data; pass none")
        if kwargs.get("data_collator") is not None:
            raise ValueError("data_collator: the loader's batches become the model's inputs by batch_inputs (model_inputs"
                             "), so a collator would never be called; override batch_inputs instead")
        if args.remove_unused_columns:
            raise ValueError(f"remove_unused_columns=True would drop the columns {dropped_columns(model, args, loader)}"
                             " that model.forward does not take, and training would run on text alone: pass "
                             "TrainingArguments(remove_unused_columns=False)")
        self.loader, self.epochs = loader, training_epochs(args)
        self.eval_loader = eval_loader_of(kwargs.get("eval_dataset"), loader)
        self._epoch_batches: dict[int, int] = {}  # an epoch's plan is a pass over the run's index: made once
        self.planned_batches = sum(self.batches_in_epoch(epoch) for epoch in range(self.epochs))
        planned_steps = math.ceil(self.planned_batches / args.gradient_accumulation_steps)
        if args.max_steps > planned_steps:
            raise ValueError(f"max_steps={args.max_steps}: the loader plans {planned_steps} optimizer steps in "
                             f"num_train_epochs={self.epochs} (of {args.gradient_accumulation_steps} batches each)")
        if args.max_steps <= 0:
            args.max_steps = planned_steps

    def batch_inputs(self, batch) -> dict:
        """The model's inputs for one packed batch (on the training device): `model_inputs`, and under flash attention
        the records' bounds (`batch.flash_attn_kwargs()`). A subclass adds what its setup needs besides."""
        inputs = model_inputs(self.model, batch)
        if is_flash_attention_requested(self.model.config.get_text_config()):
            inputs |= batch.flash_attn_kwargs()
        return inputs

    def get_train_dataloader(self) -> _TrainingBatches:
        return _TrainingBatches(self)

    def get_eval_dataloader(self, eval_dataset=None) -> _EvalBatches:
        """The eval loader's batches; `evaluate(eval_dataset=...)` takes another PackedLoader."""
        given = None if eval_dataset is None or eval_dataset is self.eval_dataset else eval_dataset
        loader = eval_loader_of(given, self.loader) or self.eval_loader
        if loader is None:
            raise ValueError("evaluation needs eval_dataset=PackedLoader(<eval run>, ...)")
        return _EvalBatches(self, loader)

    def batches_in_epoch(self, epoch: int) -> int:
        """The loader's batches of this rank in `epoch`, planned once."""
        if epoch not in self._epoch_batches:
            self._epoch_batches[epoch] = self.loader.batches_in_epoch(epoch)
        return self._epoch_batches[epoch]

    def consumed_batches(self) -> int:
        """Batches this rank has taken from the loader since the start of training, by the loader's state."""
        loader = self.loader
        return sum(self.batches_in_epoch(e) for e in range(loader.epoch)) + loader.next_pack // loader.world_size

    def get_resumed_dataloader(self, dataloader: _TrainingBatches, num_batches: int) -> _TrainingBatches:
        """The loader's restored state already stands after the batches the Trainer would skip: checked, not skipped."""
        if (consumed := self.consumed_batches()) != num_batches:
            raise ValueError(f"the checkpoint's loader state stands after {consumed} batches, its "
                             f"trainer state after {num_batches}: they were not saved together")
        return dataloader

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs):
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)  # None: the Trainer's own error
        if resume_from_checkpoint:
            state = Path(resume_from_checkpoint) / LOADER_STATE
            if not state.exists():
                raise ValueError(f"{resume_from_checkpoint} has no {LOADER_STATE}: it was not saved by a "
                                 "PackedTrainer, and resuming would read the run from its start again")
            self.loader.load_state_dict(json.loads(state.read_text()))
        return super().train(resume_from_checkpoint=resume_from_checkpoint or None, **kwargs)

    def _save_checkpoint(self, model, trial) -> None:
        """The loader's state first, so that a checkpoint folder the Trainer completes always holds it."""
        if self.args.should_save:
            folder = Path(self._get_output_dir(trial=trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            os.makedirs(folder, exist_ok=True)
            (folder / LOADER_STATE).write_text(json.dumps(self.loader.state_dict()))
        super()._save_checkpoint(model, trial)


ROW_COLUMNS = ("id", "input_ids", "image_embeds", "grid_thw", "image_spans", "token_tags")
"""The columns a row of the run needs to become a record (interop.DatasetRows)."""
CLIP_COLUMNS = ("video_embeds", "video_spans")
"""What a row whose tokens hold clips needs besides (format 3): without them its clip tokens would go in as text."""


class RowCollator:
    """For the stock `Trainer` over a `datasets` dataset of the run (`load_run_dataset`, and what `map`/`select`
    make of it): a list of rows -> a padded batch (`pad`) -> the model's inputs. The Trainer's own sampler shards
    the rows over the ranks; its resume skips batches (the PackedTrainer's loader does neither).

    Rows that lack a record's columns are refused, naming them: `remove_unused_columns=True` drops them before the
    collator sees a row, and the model would otherwise train on text alone."""

    def __init__(self, model, dataset, max_tokens: int):
        if not takes_encoder_outputs(model):
            raise ValueError(f"{type(model).__name__}.forward takes no mm_encoder_outputs: its inputs_embeds would be "
                             "computed in the DataLoader's workers, away from the model; use PackedTrainer")
        self.model, self.rows, self.max_tokens = model, DatasetRows.from_dataset(dataset), max_tokens

    def __call__(self, rows: list[dict]) -> dict:
        missing = [name for name in ROW_COLUMNS if name not in rows[0]]
        if missing:
            raise ValueError(f"the rows reach the collator without the columns {missing}: the Trainer removed them "
                             "(remove_unused_columns=True); pass TrainingArguments(remove_unused_columns=False)")
        clipped = [name for name in CLIP_COLUMNS if name not in rows[0]]
        if clipped and any(VIDEO in row["token_tags"] for row in rows):
            raise ValueError(f"rows with clips reach the collator without the columns {clipped} (removed or not "
                             f"selected): their clip tokens would train as text; keep them")
        return model_inputs(self.model, pad([self.rows.tensors(row) for row in rows], self.max_tokens))
