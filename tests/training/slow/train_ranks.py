"""PackedTrainer on a run, as `torchrun --nproc_per_node 2` starts it (gloo, CPU), for test_trainer.py.

Each rank appends one line per training step to <out>/steps-<rank>.jsonl: the step and the sha256 of the input_ids
that reached the model. `--exit-after-save K` ends every rank abruptly (os._exit) once the checkpoint of step K is
written: a kill between two steps; `--resume` starts from the last checkpoint in <out>/trainer.

    python -m torch.distributed.run --nproc_per_node 2 train_ranks.py RUN OUT [--exit-after-save K] [--resume]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path

import torch
from transformers import AutoModelForImageTextToText, TrainerCallback, TrainingArguments

from batchvlm.families import tiny_checkpoint
from batchvlm.training import LoaderConfig, PackedLoader
from batchvlm.training.trainer import PackedTrainer


class ExitAfterSave(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            torch.distributed.barrier()  # every rank past the save, then all killed at once
            os._exit(3)


class RecordingTrainer(PackedTrainer):
    def __init__(self, *args, steps_file: Path, **kwargs):
        super().__init__(*args, **kwargs)
        self.steps_file = steps_file

    def training_step(self, model, inputs, num_items_in_batch=None):
        digest = hashlib.sha256(inputs["input_ids"].numpy(force=True).tobytes()).hexdigest()
        with self.steps_file.open("a") as out:
            out.write(json.dumps({"step": self.state.global_step + 1, "input_ids": digest}) + "\n")
        return super().training_step(model, inputs, num_items_in_batch)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run")
    parser.add_argument("out", type=Path)
    parser.add_argument("--exit-after-save", type=int)
    parser.add_argument("--resume", action="store_true")
    options = parser.parse_args()
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(tiny_checkpoint("qwen2_vl"), dtype=torch.float32)
    args = TrainingArguments(output_dir=str(options.out / "trainer"), use_cpu=True, ddp_backend="gloo",
                             remove_unused_columns=False, num_train_epochs=2, save_steps=2, learning_rate=1e-4,
                             logging_steps=1, report_to=[], seed=0, dataloader_num_workers=0)
    loader = PackedLoader(options.run, LoaderConfig(max_tokens=800, shuffle_buffer=4, pack_buffer=8, num_workers=1))
    callbacks = [ExitAfterSave(options.exit_after_save)] if options.exit_after_save else []
    trainer = RecordingTrainer(model, args, loader, callbacks=callbacks,
                               steps_file=options.out / f"steps-{args.process_index}.jsonl")
    trainer.train(resume_from_checkpoint=options.resume or None)
    (options.out / f"done-{args.process_index}.json").write_text(json.dumps(
        {"max_steps": args.max_steps, "global_step": trainer.state.global_step, "loader": loader.state_dict()}))


if __name__ == "__main__":
    main()
