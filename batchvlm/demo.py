"""The embedded demo data: real photographs (scikit-image ships them) with captions, and a few deliberately bad
records. The tiny checkpoints that embed it are each family's own (`write_tiny_checkpoint` in its module).

Everything is built once, deterministically, into `$BATCHVLM_HOME` (default ~/.cache/batchvlm), and then read back
through the same paths a user's data and checkpoint take: `datasets` for the Parquet files, `from_pretrained` for
the model, tokenizer and image processor.
"""

from __future__ import annotations

import io
import os
import shutil
from pathlib import Path

import numpy as np

from batchvlm.config import ConfigError

DEMO_VERSION = "v3"  # v2: the tiny tokenizers carry chat tokens and templates; v3: the tiny checkpoints in
# their released layouts, no tensor left constant


def home() -> Path:
    return Path(os.environ.get("BATCHVLM_HOME", Path.home() / ".cache" / "batchvlm"))


def build_once(final: Path, build) -> Path:
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
    return build_once(home() / f"demo-{DEMO_VERSION}" / "data", _write_dataset)


# -- what the tiny checkpoints' tokenizers learn -------------------------------------------------------
def caption_corpus() -> list[str]:
    """The demo captions and sized phrases: what the tiny checkpoints' tokenizers are trained on."""
    captions = [row["text"].replace("<image>", "") for row in demo_rows()]
    return captions + [f"image {w}x{h}" for w in range(0, 1000, 7) for h in (10, 99, 512)]
