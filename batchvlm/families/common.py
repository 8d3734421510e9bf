"""What every family does the same way (transformers' fast image processors keep it in a base class): a family module
subclasses `PatchFamily` and states only its own rules, and builds its tiny checkpoint with `tiny_tokenizer`."""

from __future__ import annotations

import functools

import contextlib
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
from batchvlm.families.checkpoint import load_weights
from batchvlm.towers.attention import VARLEN, loaded_as
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
        self.attention = attn_implementation  # as configured: towers.attention resolves it for the device
        self.attn_implementation = loaded_as(attn_implementation)  # what transformers builds the tower with
        self.layout = layout
        self.image_token_id = token_id(tokenizer, image_token, self.name)

    @functools.cached_property
    def frame_token_ids(self) -> set[int]:
        """The ids of the frame tokens the tokenizer has (once: the vocabulary is rebuilt on every get_vocab)."""
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

    def positions(self, layout: TokenLayout, plans: list[ImagePlan],
                  clip_plans: list = ()) -> tuple[np.ndarray, int] | None:
        """A layout's position ids and rope delta, where the family has its own (M-RoPE); None: the model counts."""
        return None

    def reference_preprocess(self, images: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.reference_processor()(images=processor_inputs(images), return_tensors="pt")
        return out["pixel_values"], out["image_grid_thw"]

    def load_parts(self, vision_parts, device: torch.device, dtype: torch.dtype):
        """The family's vision parts built from config.json by `vision_parts(raw, path, dtype, attention) -> (parts,
        layouts)` and loaded strictly (checkpoint.load_weights); on the meta device, built there and checked from the
        headers alone. Returns the parts and what the check found."""
        with built_on(device):
            parts, layouts = vision_parts(read_config(self.checkpoint), self.checkpoint, dtype,
                                          self.attn_implementation)
        return parts, load_weights(self.checkpoint, layouts, parts, read=device.type != "meta")

    def check_image_token(self, image_token_id: int) -> None:
        """The checkpoint's LLM must read image embeddings where this tokenizer puts the image token."""
        if image_token_id != self.image_token_id:
            raise ConfigError(f"{self.checkpoint}: config.json's image token is {image_token_id} but the tokenizer "
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
    checkpoint = resolve_checkpoint(model)
    source = Path(model.tokenizer_path or checkpoint)
    source = source.resolve() if source.exists() else source  # a name for the hub stays as given
    template = Path(model.chat_template) if model.chat_template is not None else None
    return checkpoint, loaded_tokenizer(source, model.trust_remote_code, template,
                                        tuple(_stamp(path) for path in _files_of(source, template)))


def _files_of(source: Path, template: Path | None) -> list[Path]:
    return [*(sorted(source.iterdir()) if source.is_dir() else [source]), *([template] if template else [])]


def _stamp(path: Path) -> tuple:
    stat = path.stat() if path.exists() else None
    return (str(path), *((stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns) if stat else ()))


@functools.lru_cache(maxsize=4)
def loaded_tokenizer(source: Path, trust_remote_code: bool, template: Path | None, stamps: tuple):
    """A tokenizer, loaded once a process for the same files (`stamps`: their inodes, sizes and times): a process that
    runs the job more than once (a bench, a notebook, the tests) would parse a real vocabulary's tokenizer.json each
    time, a third of a second for Qwen2's. Shared by every family loaded from those files: the job only reads it (the
    one flag it sets, specials_as_text puts back); a caller that changes it works on a copy."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    if template is not None:
        tokenizer.chat_template = template.read_text()
    return tokenizer


def processor_inputs(images: list[np.ndarray]) -> list[torch.Tensor]:
    """HWC uint8 images as the CHW RGB tensors HF processors take (the oracle sees no alpha)."""
    return [torch.from_numpy(np.ascontiguousarray(image[..., :3])).permute(2, 0, 1) for image in images]


def token_id(tokenizer, token: str, family: str) -> int:
    found = tokenizer.convert_tokens_to_ids(token)
    if found is None or found == tokenizer.unk_token_id or tokenizer.convert_ids_to_tokens(found) != token:
        raise ConfigError(f"the tokenizer has no {token} token; {family} needs it (model.tokenizer_path)")
    return found


def optional_token_id(tokenizer, token: str) -> int | None:
    """The token's id, or None where the tokenizer lacks it (a family then takes no input that needs it)."""
    try:
        return token_id(tokenizer, token, "")
    except ConfigError:
        return None


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


def read_config(checkpoint: Path) -> dict:
    """config.json as it is published: the family reads the fields it needs by their released names."""
    try:
        return json.loads((checkpoint / "config.json").read_text())
    except ValueError as error:
        raise ConfigError(f"model.path={checkpoint}: config.json is not JSON ({error})") from None


NO_DEFAULT = object()


def config_field(path: Path, *sources: tuple, default=NO_DEFAULT):
    """A config.json field by any of its names: each source is (dict, name, ...), the released spelling first. Two
    names given different values, or none given where there is no default, are refused, naming the keys."""
    found = {name: values[name] for values, *names in sources for name in names if name in values}
    if len({json.dumps(value) for value in found.values()}) > 1:
        raise ConfigError(f"{path / 'config.json'}: {' and '.join(f'{k}={v!r}' for k, v in found.items())} "
                          "name one dimension with two values")
    if found:
        return next(iter(found.values()))
    if default is NO_DEFAULT:
        names = [name for _, *names in sources for name in names]
        raise ConfigError(f"{path / 'config.json'} gives none of {', '.join(names)}: the vision tower's shape "
                          "cannot be known")
    return default


def built_on(device: torch.device):
    """Where a family builds its vision parts: on the meta device, where only their shapes are wanted (no memory, no
    init); elsewhere as transformers builds them, before the checkpoint overwrites every tensor."""
    return torch.device("meta") if device.type == "meta" else contextlib.nullcontext()


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
    device, flash = tower.device, attention in (FLASH_ATTENTION, VARLEN)
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


def tiny_tokenizer(media_tokens: list[str], chat_template: str | None = None, ids: dict[str, int] | None = None):
    """A small byte-level BPE with the family's special tokens, trained on the demo captions: a tiny checkpoint's,
    with the chat template of the checkpoints it stands for. `ids` places special tokens at the ids a released
    checkpoint gives them (its vocabulary padded with tokens no text encodes to)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    ids = ids or {}
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    specials = ["[PAD]", "[BOS]", "[EOS]"] + [token for token in media_tokens if token not in ids]
    # show_progress=False: off a terminal, the trainer's bars reach stdout as three blank lines
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(caption_corpus(), trainer=trainer)
    if ids:
        core = _padded(core, ids)
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="[PAD]", bos_token="[BOS]",
                                   eos_token="[EOS]", additional_special_tokens=media_tokens,
                                   chat_template=chat_template)


def _padded(core, ids: dict[str, int]):
    """The trained BPE with its vocabulary run on to the largest of `ids`, those tokens at their ids, fillers
    between (no merge makes them, so no text encodes to them)."""
    from tokenizers import Tokenizer, models

    model = json.loads(core.to_str())["model"]
    vocab, at = dict(model["vocab"]), {index: token for token, index in ids.items()}
    vocab.update({at.get(index, f"<|filler_{index}|>"): index for index in range(len(vocab), max(ids.values()) + 1)})
    merges = [tuple(merge.split(" ")) if isinstance(merge, str) else tuple(merge) for merge in model["merges"]]
    padded = Tokenizer(models.BPE(vocab, merges))
    padded.pre_tokenizer, padded.decoder = core.pre_tokenizer, core.decoder
    return padded
