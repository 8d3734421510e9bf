"""What every family does the same way (transformers' fast image processors keep it in a base class): a family module
subclasses `PatchFamily` and states only its own rules, and builds its tiny checkpoint with `tiny_tokenizer`."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from batchvlm.config import ConfigError
from batchvlm.families import FLASH_ATTENTION, ModelConfig
from batchvlm.demo import caption_corpus
from batchvlm.devices import to_device
from batchvlm.families import resolve_checkpoint
from batchvlm.format.layouts import PatchLayout
from batchvlm.records import ImagePlan, TokenLayout


TEMPLATES = Path(__file__).parent / "templates"
"""Published chat templates (each checkpoint's tokenizer_config.json or chat_template.jinja on the Hugging Face Hub:
Qwen/Qwen2-VL-7B-Instruct, moonshotai/Kimi-K2.5), which the tiny checkpoints' tokenizers carry."""


class PatchFamily:
    """What every family does the same way, given its checkpoint, processor parameters and tokenizer."""

    name: str
    frame_tokens: tuple[str, ...] = ()
    """Tokens a prompt puts around an image's span (tagged FRAME), in a text's layout or a chat template's."""

    def __init__(self, checkpoint: Path, params, tokenizer, embedding: str, attn_implementation: str,
                 layout: PatchLayout, image_token: str):
        self.checkpoint = checkpoint
        self.params = params
        self.tokenizer = tokenizer
        self.embedding = embedding
        self.attn_implementation = attn_implementation
        self.layout = layout
        self.image_token_id = token_id(tokenizer, image_token, self.name)

    @property
    def frame_token_ids(self) -> set[int]:
        """The ids of the frame tokens the tokenizer has."""
        vocab = self.tokenizer.get_vocab()
        return {vocab[token] for token in self.frame_tokens if token in vocab}

    @property
    def image_mean(self) -> tuple[float, float, float]:
        return self.params.image_mean

    @property
    def image_std(self) -> tuple[float, float, float]:
        return self.params.image_std

    def encode_text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    def patchify(self, image: torch.Tensor) -> torch.Tensor:
        return self.layout.patchify(image)

    def grid_of(self, image: torch.Tensor) -> tuple[int, int, int]:
        _, h, w = image.shape
        p = self.layout.patch_size
        # True division: a size that is not a whole number of patches shows up as a fraction.
        return (1, h / p, w / p)

    def positions(self, layout: TokenLayout, plans: list[ImagePlan]) -> tuple[np.ndarray, int] | None:
        return None

    def reference_preprocess(self, images: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.reference_processor()(images=processor_inputs(images), return_tensors="pt")
        return out["pixel_values"], out["image_grid_thw"]

    def check_image_token(self, config) -> None:
        """The checkpoint's LLM must read image embeddings where this tokenizer puts the image token."""
        if config.image_token_id != self.image_token_id:
            raise ConfigError(f"{self.checkpoint}: config image_token_id={config.image_token_id} but the tokenizer "
                              f"maps its image token to {self.image_token_id} (model.tokenizer_path)")


def processor_params(cls, values: dict, overrides: dict, family: str):
    """A family's processor parameters: the checkpoint's values, then the model.processor overrides."""
    known = {f.name for f in dataclasses.fields(cls)}
    for key in overrides:
        if key not in known:
            raise ConfigError(f"model.processor.{key} is not a {family} processor parameter "
                              f"(known: {', '.join(sorted(known))})")
    values = {**values, **overrides}
    params = cls(**{k: tuple(v) if k.startswith("image_") else int(v) for k, v in values.items()})
    if any(s == 0 for s in params.image_std):
        raise ConfigError("model.processor.image_std: image normalization standard deviation must be nonzero")
    return params


def checkpoint_and_tokenizer(model: ModelConfig):
    """The local checkpoint folder (the tiny demo one when model.path is null) and its tokenizer, with the chat template
    of model.chat_template where it is given."""
    from transformers import AutoTokenizer

    checkpoint = resolve_checkpoint(model)
    tokenizer = AutoTokenizer.from_pretrained(model.tokenizer_path or checkpoint,
                                              trust_remote_code=model.trust_remote_code)
    if model.chat_template is not None:
        tokenizer.chat_template = Path(model.chat_template).read_text()
    return checkpoint, tokenizer


def processor_inputs(images: list[np.ndarray]) -> list[torch.Tensor]:
    """HWC uint8 images as the CHW RGB tensors HF processors take (the oracle sees no alpha)."""
    return [torch.from_numpy(np.ascontiguousarray(image[..., :3])).permute(2, 0, 1) for image in images]


def token_id(tokenizer, token: str, family: str) -> int:
    found = tokenizer.convert_tokens_to_ids(token)
    if found is None or found == tokenizer.unk_token_id or tokenizer.convert_ids_to_tokens(found) != token:
        raise ConfigError(f"the tokenizer has no {token} token; {family} needs it (model.tokenizer_path)")
    return found


def tokenizer_digest(tokenizer) -> str:
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]


def choose_projector(embedding: str, projector: torch.nn.Module | None) -> torch.nn.Module | None:
    """The projector to run for model.embedding: auto uses it where the checkpoint has one."""
    if embedding == "tower":
        return None
    if projector is None and embedding in ("projector", "both"):
        raise ConfigError(f"model.embedding={embedding} but the checkpoint has no projector; "
                          "use model.embedding=tower (or auto)")
    return projector


def load_submodule(checkpoint: Path, module_class, config, prefixes: tuple[str, ...], dtype: torch.dtype,
                   attn_implementation: str) -> torch.nn.Module:
    """Build one part of a checkpoint (the vision tower) from its sub-config and read only its weights.

    The language model of a VLM checkpoint is most of its bytes; only the shards that hold the part's
    tensors are opened, and only those tensors are read.
    """
    from safetensors import safe_open

    module = module_class._from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    index = checkpoint / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        shards = sorted({shard for key, shard in weight_map.items() if key.startswith(prefixes)})
    else:
        shards = ["model.safetensors"]
    state = {}
    for shard in shards:
        with safe_open(checkpoint / shard, framework="pt") as tensors:
            for key in tensors.keys():
                prefix = next((p for p in prefixes if key.startswith(p)), None)
                if prefix is not None:
                    state[key[len(prefix):]] = tensors.get_tensor(key)
    missing, unexpected = module.load_state_dict(state, strict=False)
    if missing or unexpected or not state:
        raise ConfigError(f"{checkpoint}: the weights under {' or '.join(prefixes)} do not fit "
                          f"{module_class.__name__} (missing {missing[:3]}, unexpected {unexpected[:3]})")
    return module.to(dtype)


def published_template(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text()


LONGEST_SEGMENT = {"cu_seqlens": "max_seqlen", "cu_window_seqlens": "max_window_seqlen"}
"""transformers' names of the attention boundaries a tower reads (vision_utils) and of their longest segment."""


class TowerInputError(RuntimeError):
    """A tower input in the wrong dtype or on the wrong device: a fault of batchvlm, never of a record."""


def tower_inputs(tower: torch.nn.Module, pixel_values: torch.Tensor, attention: str, indices: dict,
                 boundaries: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
    """What a transformers vision tower reads of one packed batch besides its weights, built once per batch (not per
    layer) and put where its reader reads it; returns the pixel values and the keyword arguments to call it with.

    - the pixel values, in the tower's dtype on its device;
    - `indices`: what the tower would compute from grid_thw (position ids, interpolation taps, window order...),
      computed by the caller on the host from the host grid with transformers' own helpers (vision_utils), under
      the names the tower takes them precomputed by; copied to the device here without a wait;
    - `boundaries` (cu_seqlens and kin, on the host): under flash_attention_2 the kernel reads them on the device,
      with their longest segment as an int; every other implementation splits the batch with .tolist() of them,
      on the host, where that costs no sync.

    Computed from a grid on the device, each of these would cost a sync (.tolist(), .item(), an arange sized by a
    device value), and each sync waits for the tower of the batch before. Checked here, where they are built."""
    device, flash = tower.device, attention == FLASH_ATTENTION
    kwargs = {name: placed(value, device) for name, value in indices.items()}
    for name, cu_seqlens in boundaries.items():
        kwargs[name] = to_device(cu_seqlens, device) if flash else cu_seqlens
        kwargs[LONGEST_SEGMENT[name]] = int(cu_seqlens.diff().max()) if flash and len(cu_seqlens) > 1 else None
    pixel_values = pixel_values.to(device=device, dtype=tower.dtype)
    check_tower_inputs(tower, pixel_values, kwargs, host=() if flash else tuple(boundaries))
    return pixel_values, kwargs


def placed(value, device: torch.device):
    """A tensor, or a tuple of tensors and ints (Kimi's temporal merge index), with its tensors on `device`."""
    if isinstance(value, tuple):
        return tuple(placed(item, device) for item in value)
    return to_device(value, device) if isinstance(value, torch.Tensor) else value


def check_tower_inputs(tower: torch.nn.Module, pixel_values: torch.Tensor, kwargs: dict, host: tuple[str, ...]) -> None:
    """The pixel values in the tower's dtype and on its device, every tensor argument on its device but those named in
    `host`, which must be on the host. On the CPU this catches a missing cast; a missing copy only shows on CUDA."""
    device = tower.device
    wrong = [] if (pixel_values.dtype, pixel_values.device) == (tower.dtype, device) else [
        f"pixel_values is {pixel_values.dtype} on {pixel_values.device}"]
    for name, value in kwargs.items():
        expected = torch.device("cpu") if name in host else device
        for tensor in value if isinstance(value, tuple) else (value,):
            if isinstance(tensor, torch.Tensor) and tensor.device != expected:
                wrong.append(f"{name} is on {tensor.device}")
    if wrong:
        raise TowerInputError(f"the tower ({tower.dtype} on {device}) is handed inputs it cannot read as they are: "
                              + "; ".join(wrong))


def tiny_tokenizer(media_tokens: list[str], chat_template: str | None = None):
    """A small byte-level BPE with the family's special tokens, trained on the demo captions: a tiny checkpoint's,
    with the chat template of the checkpoints it stands for."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    specials = ["[PAD]", "[BOS]", "[EOS]"] + media_tokens
    # show_progress=False: off a terminal, the trainer's bars reach stdout as three blank lines
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(caption_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="[PAD]", bos_token="[BOS]",
                                   eos_token="[EOS]", additional_special_tokens=media_tokens,
                                   chat_template=chat_template)
