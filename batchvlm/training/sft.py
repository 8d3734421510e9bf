"""TRL's `SFTTrainer` on batchvlm's packed loader: TRL's loss, metrics and options, batchvlm's data.

`PackedSFTTrainer` is `PackedTrainer` (the loader never handed to accelerate, its state in every checkpoint,
`max_steps` from its plan, `remove_unused_columns=True` refused naming the columns) with `SFTTrainer` underneath.
What TRL 1.16 would otherwise do to stored features, and what this class does about it:
- TRL counts the tokens of a batch without an attention mask as `position_ids.size(1)`: 1 for the `[4, 1, L]`
  M-RoPE positions of a packed Qwen batch, so its logged `num_tokens` would count batches. The count here is the
  packed length (the labels' numel), or the attention mask's sum for a padded batch, as TRL counts those.
- TRL's own check that a dataset with mask columns has `labels` only runs with its own collator. Here the labels come
  from the stored `loss_mask` (`pack`), and a batch that reaches the loss without them (a `batch_inputs` override
  that drops them) is refused, where TRL's fused loss would fail on `labels[:, 1:]` of None.
- TRL packs and pads text, tokenizes, and builds labels from a dataset; the loader's batches are already packed
  sequences with labels, so its packing, padding-free and loss-masking options are refused, and its dataset
  preparation is skipped. It still wants a `datasets` dataset to look at: the run's shards, streamed, of which it
  reads the first row (no `image`/`images` column, so TRL treats it as text and gates none of its options).
- The processing class is the tokenizer (saved with every checkpoint), not the processor: no pixels are processed.

TRL is an optional dependency (`pip install trl`, in the `dev` extra); this module alone imports it.
"""

from __future__ import annotations

import torch

from batchvlm.training.loader import PackedLoader
from batchvlm.training.trainer import PackedTrainer

try:
    from trl import SFTConfig, SFTTrainer
except ImportError as missing:  # the package works without TRL; this module is its TRL recipe
    raise ImportError("batchvlm.training.sft is the TRL recipe and needs TRL: pip install trl") from missing

REFUSED_OPTIONS = {
    "packing": "the loader's batches are packed sequences already (first-fit-decreasing, positions restarted per record)",
    "padding_free": "the loader's batches are packed sequences already, without padding",
    "assistant_only_loss": "the stored loss_mask decides which tokens train (the labels of pack)",
    "completion_only_loss": "the stored loss_mask decides which tokens train (the labels of pack)",
}
"""SFTConfig options that would act on data the loader has already prepared, and why each is refused."""


def refused_options(args: SFTConfig) -> dict[str, str]:
    return {name: why for name, why in REFUSED_OPTIONS.items() if getattr(args, name)}


def run_rows(loader: PackedLoader):
    """The loader's shards as a streamed `datasets` dataset: what SFTTrainer insists on being given. It reads the first
    row to decide what kind of data it has; the training batches are the loader's."""
    import datasets

    return datasets.load_dataset("parquet", data_files=[str(path) for path in loader.index.shards], split="train",
                                 streaming=True)


class PackedSFTTrainer(PackedTrainer, SFTTrainer):
    """`SFTTrainer(model, args, processing_class=tokenizer, ...)` training on `loader` (a PackedLoader over a run) for
    `args.num_train_epochs` loader epochs. `args` is an `SFTConfig` with `remove_unused_columns=False`; every other
    SFTTrainer argument but a dataset and a collator works as usual (PEFT, callbacks, optimizers...). `eval_dataset`
    is a PackedLoader of its own over the eval run (PackedTrainer's)."""

    def __init__(self, model, args: SFTConfig, loader: PackedLoader, processing_class, **kwargs):
        if not isinstance(args, SFTConfig):
            raise TypeError(f"args: an SFTConfig (trl), got {type(args).__name__}")
        refused = refused_options(args)
        if refused:
            raise ValueError("; ".join(f"SFTConfig({name}=...): {why}" for name, why in refused.items()))
        self.take_loader(model, args, loader, kwargs)
        args.dataset_kwargs = {**(args.dataset_kwargs or {}), "skip_prepare_dataset": True}
        if self.eval_loader is not None:  # TRL looks at a `datasets` dataset; the batches are the eval loader's
            kwargs["eval_dataset"] = run_rows(self.eval_loader)
        SFTTrainer.__init__(self, model=model, args=args, train_dataset=run_rows(loader),
                            processing_class=processing_class, **kwargs)

    def compute_loss(self, model, inputs: dict, return_outputs: bool = False, num_items_in_batch=None):
        if inputs.get("labels") is None:
            raise ValueError(f"a training batch reached the loss without labels (its keys: {sorted(inputs)}): the "
                             "labels are the stored loss_mask's (model_inputs gives them); a batch_inputs override "
                             "must keep them, or training would have no target")
        counted = self._total_train_tokens
        result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if self.model.training and "attention_mask" not in inputs:
            self._count_packed_tokens(inputs["labels"], counted)
        return result

    def _count_packed_tokens(self, labels: torch.Tensor, counted: int) -> None:
        """TRL's running token count, with this packed batch's tokens (every position of it is a token) in place of
        what TRL added for it from `position_ids.size(1)`."""
        tokens = torch.tensor(labels.numel(), device=labels.device)
        batch = self.accelerator.gather_for_metrics(tokens).sum().item()
        self._total_train_tokens = counted + batch // self._tp_size
        self._metrics["train"]["num_tokens"] = [self._total_train_tokens]
