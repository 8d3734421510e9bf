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

DEMO_VERSION = "v4"  # v2: the tiny tokenizers carry chat tokens and templates; v3: the tiny checkpoints in
# their released layouts, no tensor left constant; v4: the tiny SigLIP2 tokenizer has a clip token


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


# -- clips -------------------------------------------------------------------------------------------
def camera_move(photo: np.ndarray, frames: int, height: int, width: int, zoom: bool = False) -> np.ndarray:
    """(frames, height, width, 3) uint8: a camera panning across a photograph (or zooming into it), frame by frame."""
    rows, cols = photo.shape[:2]
    out = np.empty((frames, height, width, 3), dtype=np.uint8)
    for index in range(frames):
        step = index / max(frames - 1, 1)
        scale = 1.0 - 0.5 * step if zoom else 0.6
        h, w = int(rows * scale), int(cols * scale)
        top, left = ((rows - h) // 2, (cols - w) // 2) if zoom else ((rows - h) // 2, int((cols - w) * step))
        crop = photo[top:top + h, left:left + w]
        y, x = np.arange(height) * h // height, np.arange(width) * w // width
        out[index] = crop[y][:, x]
    return out


def encode_clip(frames: np.ndarray, fps: int, codec: str = "libx264", container: str = "mp4") -> bytes:
    """The frames encoded with PyAV (its wheels bundle FFmpeg's encoders)."""
    import av

    buffer = io.BytesIO()
    with av.open(buffer, "w", format=container) as out:
        stream = out.add_stream(codec, rate=fps)
        stream.height, stream.width, stream.pix_fmt = frames.shape[1], frames.shape[2], "yuv420p"
        for pixels in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buffer.getvalue()


def _write_clips(folder: Path) -> None:
    """LLaVA records with clips (made from the photographs) and a photo, one clip cut short (video.truncated); and the
    same clips captioned (plain text, a `videos` column: what a SigLIP2 run reads)."""
    import json

    from PIL import Image

    data = photographs()
    gray = lambda a: np.repeat(a[..., None], 3, axis=-1)  # noqa: E731
    clips = {"astronaut_pan.mp4": encode_clip(camera_move(data.astronaut(), 24, 112, 168), 8),
             "coffee_zoom.webm": encode_clip(camera_move(data.coffee(), 16, 112, 140, zoom=True), 8, "libvpx", "webm"),
             "moon_pan.mp4": encode_clip(camera_move(gray(data.moon()), 20, 84, 140), 10)}
    cut = encode_clip(camera_move(data.rocket(), 40, 84, 112), 10, "libvpx", "webm")
    clips["bad_cut_short.webm"] = cut[:len(cut) * 2 // 3]
    for name, clip in clips.items():
        (folder / name).write_bytes(clip)
    Image.fromarray(data.chelsea()[::2, ::2]).save(folder / "chelsea.jpg", quality=90)

    def record(rid: str, videos: list[str], images: list[str], question: str, answer: str) -> dict:
        return {"id": rid, "video": videos, "image": images,
                "conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]}

    records = [
        record("astronaut_pan", ["astronaut_pan.mp4"], [], "<video>\nWhat does the camera show?",
               "It pans across an astronaut in a white suit."),
        record("coffee_zoom_and_cat", ["coffee_zoom.webm"], ["chelsea.jpg"],
               "<video> zooms into a cup; <image> is a cat. What do they share?", "Both are seen up close."),
        record("moon_and_astronaut", ["moon_pan.mp4", "astronaut_pan.mp4"], [], "Compare <video> with <video>.",
               "Craters first, then an astronaut."),
        record("bad_cut_short", ["bad_cut_short.webm"], [], "<video> What happens at the launch?", "A rocket."),
    ]
    (folder / "clips.json").write_text(json.dumps(records, indent=1))
    captions = {"astronaut_pan": "<video> The camera pans across an astronaut in a white suit.",
                "coffee_zoom_and_cat": "<video> zooms into a cup of coffee; <image> is a cat.",
                "moon_and_astronaut": "<video> Craters, then <video> an astronaut.",
                "bad_cut_short": "<video> A rocket launch."}
    (folder / "captions.jsonl").write_text("".join(
        json.dumps({"id": r["id"], "text": captions[r["id"]], "images": r["image"], "videos": r["video"]}) + "\n"
        for r in records))


def demo_clips(name: str = "clips.json") -> str:
    """The demo's clip records, built on first use: LLaVA JSON (`clips.json`, `dataset=demo_clips`), or the same clips
    captioned (`captions.jsonl`, `dataset=demo_captioned_clips`)."""
    return str(build_once(home() / f"demo-clips-{DEMO_VERSION}", _write_clips) / name)


# -- what the tiny checkpoints' tokenizers learn -------------------------------------------------------
def caption_corpus() -> list[str]:
    """The demo captions and sized phrases: what the tiny checkpoints' tokenizers are trained on."""
    captions = [row["text"].replace("<image>", "") for row in demo_rows()]
    return captions + [f"image {w}x{h}" for w in range(0, 1000, 7) for h in (10, 99, 512)]
