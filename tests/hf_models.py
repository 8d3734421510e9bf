"""transformers' own model of a checkpoint, loaded by its own from_pretrained (which maps the stored names to its
modules itself): the oracle the tests hold the job's embeddings and stored outputs to."""

from __future__ import annotations


def pretrained(checkpoint, model_class=None, **kwargs):
    """`model_class.from_pretrained(checkpoint, **kwargs)` in eval mode (AutoModelForImageTextToText by default),
    Kimi's config read as the family reads it (families.full_model)."""
    from batchvlm.families import full_model

    return full_model(checkpoint, model_class, **kwargs).eval()
