"""The embedded demo: real photographs (scikit-image ships them) with captions, a few deliberately
bad records, and a tiny checkpoint per family built from a config with a fixed seed.

Everything is built once, deterministically, into `$BATCHVLM_HOME` (default ~/.cache/batchvlm), and
then read back through the same paths a user's data and checkpoint take: `datasets` for the
Parquet files, `from_pretrained` for the model, tokenizer and image processor.
"""

from __future__ import annotations

import io
import os
import shutil
from pathlib import Path

import numpy as np

from batchvlm.config import ConfigError, ModelConfig

DEMO_VERSION = "v1"
MEDIA_TOKENS = ["<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>",
                "<|kimi_k25_video_placeholder|>"]
QWEN_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
SIGLIP_TOKENS = ["<start_of_image>", "<image_soft_token>", "<end_of_image>"]


def home() -> Path:
    return Path(os.environ.get("BATCHVLM_HOME", Path.home() / ".cache" / "batchvlm"))


def _build_once(final: Path, build) -> Path:
    """Build into a temporary folder and rename it into place, so concurrent ranks never see half a build."""
    if final.exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    build(tmp)
    try:
        os.rename(tmp, final)
    except OSError:  # another process won the race; its build is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return final


# -- dataset -----------------------------------------------------------------------------------
def photographs():
    """scikit-image's bundled photographs (`skimage.data`). It is the `demo` extra, not a dependency of the job:
    a production install reads its own data and checkpoints."""
    try:
        from skimage import data
    except ImportError as error:
        raise ConfigError("the embedded demo (dataset=demo, the *_tiny models) and the benchmark need scikit-image: "
                          "pip install 'batchvlm[demo]'") from error
    return data


def _encode(pixels: np.ndarray, fmt: str, **options) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=fmt, **options)
    return buffer.getvalue()


def demo_rows() -> list[dict]:
    """The demo records: id, list of encoded images, caption with one `<image>` per image."""
    data = photographs()
    astronaut, coffee, chelsea, rocket = data.astronaut(), data.coffee(), data.chelsea(), data.rocket()
    hubble, camera, coins, page, moon = data.hubble_deep_field(), data.camera(), data.coins(), data.page(), data.moon()
    retina = data.retina()[::2, ::2]  # 706x706: a large photo that still encodes in a second on a CPU
    jpeg = lambda a: _encode(a, "JPEG", quality=90)  # noqa: E731
    png = lambda a: _encode(a, "PNG")  # noqa: E731
    truncated = jpeg(coffee)
    rows = [
        ("astronaut", [jpeg(astronaut)], "<image>\nAn astronaut in a white suit poses in front of a flag."),
        ("coffee", [jpeg(coffee)], "<image> A cup of coffee on a saucer, seen from above."),
        ("chelsea", [_encode(chelsea, "WEBP", quality=90)], "A tabby cat looks to the side. <image>"),
        ("rocket", [jpeg(rocket)], "<image> A rocket stands on the launch pad at dusk."),
        ("hubble", [jpeg(hubble)], "Deep field: <image> thousands of galaxies in one small patch of sky."),
        ("retina", [jpeg(retina)], "<image> A fundus photograph of a human retina."),
        ("camera", [png(camera)], "<image> A man with a camera on a tripod, in grayscale."),
        ("coins", [png(coins)], "<image> Old coins laid out on a dark background."),
        ("page", [png(page)], "<image> A scanned page of printed text."),
        ("rocket_strip", [jpeg(rocket[150:230])], "<image> A wide strip across the launch tower."),
        ("coffee_tall", [jpeg(coffee[:, 250:330])], "<image> A tall slice through the coffee cup."),
        ("chelsea_tiny", [png(chelsea[140:160, 200:220])], "<image> A tiny crop of fur."),
        ("cat_and_coffee", [jpeg(chelsea), jpeg(coffee)], "Compare <image> with <image>: a cat and a cup."),
        ("astronaut_pair", [jpeg(astronaut), jpeg(astronaut[40:240, 150:350])],
         "<image><image> The astronaut, and a close-up of the face."),
        ("space_trio", [jpeg(hubble), jpeg(rocket), jpeg(astronaut)],
         "From <image> to <image> to <image>: galaxies, a rocket and the astronaut."),
        ("logo_rgba", [png(data.logo())], "<image> The scikit-image logo on a transparent background."),
        ("moon_no_placeholder", [png(moon)], "The surface of the moon, full of craters."),
        ("text_only", [], "A caption with no image at all."),
        ("bad_truncated_jpeg", [truncated[: len(truncated) * 2 // 5]], "<image> A coffee photo cut short."),
        ("bad_not_an_image", [b"<html><body><h1>404 Not Found</h1></body></html>"], "<image> A web page saved as .jpg."),
        ("bad_placeholder_count", [jpeg(coins)], "<image> and <image>: two placeholders for a single image."),
    ]
    return [{"id": rid, "images": images, "text": text} for rid, images, text in rows]


def _write_dataset(folder: Path) -> None:
    import datasets

    features = datasets.Features({"id": datasets.Value("string"),
                                  "images": datasets.List(datasets.Image()),
                                  "text": datasets.Value("string")})
    rows = demo_rows()
    halves = [rows[:11], rows[11:]]
    for index, part in enumerate(halves):
        table = {"id": [r["id"] for r in part], "text": [r["text"] for r in part],
                 "images": [[{"bytes": b, "path": None} for b in r["images"]] for r in part]}
        datasets.Dataset.from_dict(table, features=features).to_parquet(str(folder / f"demo-{index:03d}.parquet"))


def demo_dataset() -> Path:
    """Folder of the demo's Parquet files (built on first use)."""
    return _build_once(home() / f"demo-{DEMO_VERSION}" / "data", _write_dataset)


# -- tiny checkpoints --------------------------------------------------------------------------
def build_tokenizer(texts: list[str], media_tokens: list[str]):
    """A small byte-level BPE with the family's special tokens, trained on the demo captions."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    specials = ["[PAD]", "[BOS]", "[EOS]"] + media_tokens
    # show_progress=False: off a terminal, the trainer's bars reach stdout as three blank lines
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="[PAD]", bos_token="[BOS]",
                                   eos_token="[EOS]", additional_special_tokens=media_tokens)


def _caption_corpus() -> list[str]:
    captions = [row["text"].replace("<image>", "") for row in demo_rows()]
    return captions + [f"image {w}x{h}" for w in range(0, 1000, 7) for h in (10, 99, 512)]


TINY_KIMI_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                        pos_emb_height=16, pos_emb_width=16)
BASE_KIMI_VISION = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                        pos_emb_height=64, pos_emb_width=64)
"""A ViT-B-sized MoonViT for the end-to-end benchmark, where the tower must cost what a real one does."""


def _write_kimi_k25(folder: Path, vision: dict = TINY_KIMI_VISION) -> None:
    import torch
    from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration, Kimi_K25ImageProcessor

    tokenizer = build_tokenizer(_caption_corpus(), MEDIA_TOKENS)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in MEDIA_TOKENS}
    config = Kimi_K25Config(
        text_config=dict(model_type="deepseek_v3", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         moe_intermediate_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
                         n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                         kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                         max_position_embeddings=8192, n_group=1, topk_group=1),
        vision_config=dict(**vision, patch_size=14, rope_parameters={"rope_type": "axial", "rope_theta": 10000.0}),
        projection_hidden_size=vision["hidden_size"], image_token_id=ids["<|media_pad|>"],
        video_token_id=ids["<|kimi_k25_video_placeholder|>"], vision_start_token_id=ids["<|media_begin|>"],
        vision_end_token_id=ids["<|media_end|>"], tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Kimi_K25ForConditionalGeneration(config).eval()
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    Kimi_K25ImageProcessor(patch_size=14, merge_size=2, max_patches=16384,
                           size={"max_height": 512, "max_width": 512}).save_pretrained(folder)


def _write_qwen2_vl(folder: Path) -> None:
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessor

    tokenizer = build_tokenizer(_caption_corpus(), QWEN_TOKENS)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in QWEN_TOKENS}
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=2, embed_dim=32, num_heads=2, hidden_size=64, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen2VLForConditionalGeneration(config).eval().save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    # A small max_pixels keeps the demo fast on a CPU and sends its larger photos down the shrinking branch.
    Qwen2VLImageProcessor(size={"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 256}).save_pretrained(folder)


def _write_siglip2(folder: Path) -> None:
    import torch
    from transformers import Siglip2ImageProcessor, Siglip2VisionConfig, Siglip2VisionModel

    tokenizer = build_tokenizer(_caption_corpus(), SIGLIP_TOKENS)
    config = Siglip2VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                 patch_size=16, num_patches=256, vision_use_head=True)
    torch.manual_seed(0)
    Siglip2VisionModel(config).eval().save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    Siglip2ImageProcessor(patch_size=16, max_num_patches=256).save_pretrained(folder)


TINY_CHECKPOINTS = {"kimi_k25": _write_kimi_k25, "qwen2_vl": _write_qwen2_vl, "siglip2": _write_siglip2}


def tiny_checkpoint(family: str) -> Path:
    return _build_once(home() / f"demo-{DEMO_VERSION}" / f"{family}_tiny", TINY_CHECKPOINTS[family])


def base_kimi_checkpoint() -> Path:
    return _build_once(home() / f"demo-{DEMO_VERSION}" / "kimi_k25_base",
                       lambda folder: _write_kimi_k25(folder, BASE_KIMI_VISION))


def resolve_checkpoint(model: ModelConfig) -> Path:
    from batchvlm.config import ConfigError

    if model.path is None:
        return tiny_checkpoint(model.family)
    path = Path(model.path)
    if not (path / "config.json").exists():
        raise ConfigError(f"model.path={model.path!r} is not a checkpoint folder (no config.json); "
                          "batchvlm reads local checkpoints only")
    return path
