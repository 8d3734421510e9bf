"""transformers' own model of a checkpoint, loaded by its own from_pretrained (which maps the stored names to its
modules itself): the oracle the tests hold the job's embeddings and stored outputs to."""

from __future__ import annotations

import contextlib


def pretrained(checkpoint, model_class=None, **kwargs):
    """`model_class.from_pretrained(checkpoint, **kwargs)` in eval mode (AutoModelForImageTextToText by default),
    Kimi's config read as the family reads it (families.full_model)."""
    from batchvlm.families import full_model

    return full_model(checkpoint, model_class, **kwargs).eval()


def lfm2_vl_over(siglip2_checkpoint, folder):
    """An LFM2-VL checkpoint (transformers' `lfm2_vl`: a SigLIP2 NaFlex tower, a pixel-unshuffle projector, an LFM2
    language model) whose tower is the given SigLIP2 checkpoint's, saved with save_pretrained and loaded back.

    Its vision_config is the SigLIP2 checkpoint's (without the pooling head, as LFM2-VL's released configs set it);
    the projector's and the language model's biases and norms get non-trivial values (init leaves them 0 and 1)."""
    import torch
    from transformers import Lfm2VlConfig, Lfm2VlForConditionalGeneration, Siglip2Model

    siglip = Siglip2Model.from_pretrained(siglip2_checkpoint)
    vision = siglip.config.vision_config.to_dict() | {"vision_use_head": False}
    text = dict(model_type="lfm2", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, layer_types=["conv", "full_attention"])
    config = Lfm2VlConfig(vision_config=vision, text_config=text, image_token_id=LFM2_IMAGE_TOKEN,
                          projector_hidden_size=48, downsample_factor=2)
    model = Lfm2VlForConditionalGeneration(config)
    model.model.vision_tower.load_state_dict({name: value for name, value in siglip.vision_model.state_dict().items()
                                              if not name.startswith("head.")})
    nontrivial_biases_and_norms(model.model.multi_modal_projector, model.model.language_model)
    model.save_pretrained(folder)
    return Lfm2VlForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()


LFM2_IMAGE_TOKEN = 400


def nontrivial_biases_and_norms(*modules) -> None:
    """Biases and norm weights moved off the 0 and 1 that initialization leaves them at, so that a layer applied in
    the wrong place cannot hide behind an identity."""
    import torch

    generator = torch.Generator().manual_seed(30)
    with torch.no_grad():
        for module in modules:
            for name, parameter in module.named_parameters():
                if name.endswith("bias") or "norm" in name:
                    parameter.add_(0.2 * torch.randn(parameter.shape, generator=generator))


@contextlib.contextmanager
def never_called(module):
    """`module`'s forward raises while the block runs: a call of it (a vision tower, where stored rows stand in for
    it) fails the test."""
    def never(*_, **__):
        raise AssertionError("the vision tower ran")

    module.forward = never
    try:
        yield
    finally:
        del module.forward
