"""The check catalogue: every invariant batchvlm enforces, in one place, and the one exception type.

A check has a stable dotted name (it appears in quarantine rows, reports and docs/checks.md), the stage
that runs it, the condition it asserts and the failure it guards against.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchvlm.records import Failure


@dataclass(frozen=True)
class Check:
    name: str
    condition: str
    guards_against: str
    remedy: str

    @property
    def stage(self) -> str:
        return self.name.split(".", 1)[0]


CATALOGUE: dict[str, Check] = {
    check.name: check
    for check in [
        Check("source.missing_id", "the record's id column is not null or empty",
              "rows that cannot be traced back to the dataset", "fill the id column or choose another with dataset.id_column"),
        Check("source.duplicate_id", "no id appears twice in the run: within a unit as it is read, across units in "
              "the hash-partitioned pass at the end; the first occurrence (plan order, then row) is kept",
              "two rows that a reader cannot tell apart", "deduplicate the dataset or choose a unique dataset.id_column"),
        Check("source.download_failed", "the row's dataset.status_column is `success` (img2dataset)",
              "a failed download written as a text-only row", "re-download the image, or drop the row"),
        Check("source.malformed_row", "a JSON Lines line or JSON array element is a JSON object",
              "a broken line taking the whole unit down, or read as an empty record",
              "fix the line (its byte offset is the quarantined row)"),
        Check("source.missing_image", "with dataset.require_images, the row has at least one image",
              "an image-text dataset row with its image missing, written as text only",
              "fix the row, or set dataset.require_images=false for a dataset with text-only rows"),
        Check("source.truncated", "an input reads to its end (a tar shard does not stop inside a member)",
              "a partly copied shard whose tail is lost without a record of it; the samples before it are kept",
              "re-copy the shard; rerunning after a fix is a requeue of source.truncated"),
        Check("source.missing_input", "a file that a brace pattern too large to list names exists when its unit is "
              "read", "a gap in a shard list of a billion names, found only as its unit is read, failing the job",
              "fix the pattern, or leave the gap: the unit commits with this one record"),
        Check("source.bad_metadata", "a sample's metadata (its .json part) is a JSON object",
              "a sample whose id, status or caption fields cannot be read", "fix the sample's .json"),
        Check("source.unrecognised_sample", "a sample has a part the config names: an image part, the text part or "
              "its .json", "a sample of unknown parts written as an empty, image-less row",
              "name its parts in dataset.images_column / dataset.text_column, or drop the sample"),
        Check("source.invalid_id", "the record's id is a string or an integer",
              "a float, bool, list or object id written as its str(): ids that collide (1 and 1.0) or that no one "
              "looks up", "give the records string or integer ids, or choose another dataset.id_column"),
        Check("source.invalid_unicode", "every string the record holds (its id, text or turns, image paths) is text "
              "UTF-8 can encode: no lone surrogate (`\\ud800` is valid JSON), no byte that is not UTF-8",
              "a string no Parquet file can store, stopping the job at the write on every relaunch",
              "fix the record's encoding; its quarantine row holds those strings with backslash escapes"),
        Check("decode.unreadable", "the bytes are an image Pillow can identify",
              "bytes that are not an image (HTML saved as .jpg, random bytes, empty files)", "fix or drop the file"),
        Check("decode.format_not_allowed", "the format, read from the content, is in decode.formats",
              "risky decoders (EPS runs Ghostscript, PSD, ...) reached through a spoofed extension",
              "convert the image to an allowed format, or extend decode.formats deliberately"),
        Check("decode.too_many_pixels", "width x height from the header <= decode.max_pixels",
              "decompression bombs and out-of-memory on huge images", "downscale the source or raise decode.max_pixels"),
        Check("decode.too_many_bytes", "the encoded image (or the file or tar member it is read from, by its declared "
              "size, before any byte is read) is at most decode.max_bytes",
              "a huge or sparse file, or a tar member, read whole into memory before any limit applies",
              "re-encode the image smaller or raise decode.max_bytes"),
        Check("decode.path_outside_root", "an image named by path lies under the dataset's image root "
              "(dataset.image_root, else the folder of the input naming it), links followed; it is never opened",
              "a dataset that names /etc/passwd, ../ paths or another user's files, and learns from the outcome "
              "whether they exist", "move the images under the root, or set dataset.image_root to their folder"),
        Check("decode.not_a_file", "an image named by path is a regular file",
              "a FIFO, device or folder that hangs or floods the job", "point the path at the image file"),
        Check("decode.truncated", "the whole image decodes",
              "a partly decoded image whose missing rows would be embedded as black", "re-fetch the file"),
        Check("decode.failed", "the decoder raises no other error",
              "a malformed file that crashes the decoder", "re-encode the file"),
        Check("decode.crashed", "the decoder process survives the image",
              "a segfault or abort in a C decoder taking the whole job down", "drop or re-encode the file; report it to Pillow"),
        Check("decode.timeout", "the image decodes within decode.timeout_s",
              "algorithmic-complexity inputs (TIFF IFD chains, many-frame files) stalling a worker forever",
              "re-encode the file or raise decode.timeout_s"),
        Check("decode.missing_file", "an image given as a path exists and can be read",
              "dangling paths in the dataset", "fix the path or the dataset root"),
        Check("video.too_many_bytes", "the clip's file (by its size, before any byte is read) is at most "
              "video.max_bytes", "a huge or sparse file read whole into memory before any limit applies",
              "cut or re-encode the clip, or raise video.max_bytes"),
        Check("video.crashed", "the decoder process survives the clip",
              "a segfault or abort in FFmpeg taking the whole job down", "drop or re-encode the clip"),
        Check("video.timeout", "the clip is read, probed and its sampled frames decoded within video.timeout_s",
              "a stream stalling a worker forever", "re-encode the clip or raise video.timeout_s"),
        Check("video.unreadable", "the bytes are a container PyAV (FFmpeg) can open",
              "bytes that are not a video (an HTML page saved as .mp4, an MP4 cut before its moov index)",
              "fix or drop the file; its first bytes and FFmpeg's error are the evidence"),
        Check("video.no_stream", "the container has a video stream (an attached picture, an MP3's cover art, is not one)",
              "an audio-only or subtitle-only file reaching the sampler", "drop the file; the streams it has are listed"),
        Check("video.fps_invalid", "the stream's frame rate is in (0, video.max_fps] and every frame has a timestamp",
              "a sampler dividing by a zero or absurd frame rate, frames placed in time by a broken header",
              "re-mux the clip with a frame rate (ffmpeg -r)"),
        Check("video.too_long", "the duration and frame count (the header's, then the demuxed packets') are within "
              "video.max_duration_s and video.max_frames", "a clip of hours planned, demuxed and decoded before any "
              "limit applies", "cut the clip or raise the limits"),
        Check("video.decode_bomb", "a frame's width x height <= video.max_frame_pixels and the sampled frames' RGB "
              "bytes <= video.max_decoded_bytes, from the header before a frame is decoded, then from the first decoded",
              "host memory exhausted by many large frames (30 s of 720p taking a terabyte), or a stream that grows "
              "after its header", "sample fewer frames, downscale the clip or raise the limits"),
        Check("video.frame_size", "every sampled frame has the size of the first (a stream may change resolution "
              "mid-clip)", "frames no single resize plan fits, written over an array sized for the first",
              "re-encode the clip at one size"),
        Check("video.too_few_frames", "the stream holds a frame, and as many as the family's sampling needs",
              "an empty stream, or a sampler raising on a clip shorter than its minimum",
              "drop the clip; the header's and the demuxed frame counts are the evidence"),
        Check("video.truncated", "the stream holds the frames its header states, and decodes in order through the last "
              "sampled frame", "a partly copied clip whose missing frames would be sampled as others, or a dropped frame "
              "shifting every later one", "re-fetch the file; the codec's error is kept"),
        Check("text.placeholder_count", "placeholders in the text (a conversation: in all its turns, `<image>` "
              "placeholders or `{type: image}` blocks) == images of the record, and its `<video>` placeholders (a "
              "conversation's, or a plain text's that dataset.videos_column gives clips) or `{type: video}` blocks "
              "== its clips",
              "an image with no place in the sequence, or a placeholder with no image",
              "fix the text, or set dataset.missing_placeholder=prepend for image-first datasets"),
        Check("text.roles", "a conversation's roles are system, user, assistant or tool (llava: human, gpt, system), "
              "in order: system only first, then user first; an assistant turn follows a user or tool turn, a tool "
              "turn an assistant or tool turn, a user turn anything but a user turn",
              "turns a chat template renders into a sequence no trainer would build, or silently renders wrong",
              "fix the record's turns (or the roles' names)"),
        Check("text.not_a_string", "each turn's role and text is there and is a string (llava: from, value; "
              "messages: role, and content or each text block's text; cauldron: user, assistant), and so is a plain "
              "record's text (or null)",
              "a number rendered as its str(), a null as an empty turn, a list or object reaching the tokenizer",
              "fix the record's turns"),
        Check("text.video", "a record holds a clip (a `<video>` placeholder, a `{type: video}` block, a clip in llava's "
              "`video`, messages' `videos` or dataset.videos_column's column) only where its dataset and family take "
              "clips: llava, messages or a dataset.videos_column, and a family with a video rule (Qwen2-VL, "
              "Qwen2.5-VL, Qwen3-VL, Kimi-K2.5 where its checkpoint reads clips at its clip token, SigLIP2 with a "
              "`<video_soft_token>` in its tokenizer)",
              "a video's placeholder embedded as plain text and its frames never, or a clip dropped unseen",
              "leave video records out of runs of those families and formats until their clips are supported"),
        Check("text.control_token", "no text of a record (any turn's content, a plain text) tokenizes into one of the "
              "tokenizer's special tokens (`<|im_end|>`, `<|im_start|>`, `<|image_pad|>`...)",
              "a record forging turns or images with the template's control strings, and a mask that trains them",
              "clean the text, or set text.control_tokens=text to tokenize such strings as plain text"),
        Check("text.chat_template", "the chat template renders the conversation, with one image token per image "
              "and every turn's text verbatim",
              "a template that raises on the record, drops an image (Qwen3-VL renders none in assistant or system "
              "turns) or rewrites a turn, so its labels could not be placed",
              "fix the record, or give a template that renders it with model.chat_template"),
        Check("text.too_long", "the record's tokens <= text.max_tokens (after text.overflow=drop_turns dropped "
              "whole trailing turns, never part of an image)",
              "a trainer cutting the sequence inside an image span, or dropping it silently",
              "raise text.max_tokens, set text.overflow=drop_turns, or split the conversation"),
        Check("text.no_trained_tokens", "a conversation has at least one trained token (text.train_on)",
              "a record that costs a training step and teaches nothing (no assistant turn, or only empty ones)",
              "fix the record, or choose text.train_on=all"),
        Check("text.image_span_count", "runs of image tokens found in input_ids (non-circular) == images",
              "adjacent images merging into one span, so the trainer splits embeddings at the wrong place",
              "use a framed prompt contract (model.framing=k3) or separate the placeholders with text"),
        Check("text.span_length", "each span's length == that image's planned tokens",
              "a truncated or merged span, so embeddings land on the wrong tokens", "a family or tokenizer bug: report it"),
        Check("text.position_ids", "M-RoPE position ids have shape (3, seq_len) and rope delta == max + 1 - seq_len",
              "rotary positions that do not match the sequence, silently shifting every token after an image",
              "a family bug: report it"),
        Check("plan.size_rule", "the image fits the family's size rule (e.g. Qwen: aspect ratio <= 200)",
              "an image the processor rejects or the tower cannot take", "crop or pad the image to a sane aspect ratio"),
        Check("preprocess.feature_length", "pixel rows == sum(prod(grid_thw)) over the batch",
              "a preprocessing backend that drops or duplicates patches", "a backend bug: try preprocess.backend=reference"),
        Check("preprocess.grid_match", "grids measured from the preprocessed pixels == planned grids",
              "a preprocessing path whose output shape drifted from the plan", "a backend bug: try preprocess.backend=reference"),
        Check("preprocess.parity", "on sampled images and clips (preprocess.parity_sample_rate): pixels within "
              "preprocess.parity_max_levels uint8 levels of the family's HF processor (of the CPU path for RGBA, "
              "which the HF processors do not composite; a clip's frames against its video processor, `video_index`)",
              "a backend whose pixels drift from the checkpoint's processor while every shape stays right",
              "a backend bug: try preprocess.backend=torch or reference"),
        Check("encode.packed_tokens", "packed rows == sum of t*h*w over the batch; cu_seqlens starts at 0, increases, ends at the total",
              "a packed batch whose attention segments cross image boundaries", "a packing bug: report it"),
        Check("encode.output_tokens", "tokens the tower returns for each image == its planned tokens",
              "embeddings that do not fit the placeholder span", "the checkpoint and its processor config disagree"),
        Check("encode.finite", "no NaN or Inf in the embeddings",
              "a poisoned training step", "check the checkpoint, model.dtype and the image"),
        Check("encode.failed", "the tower runs on the record without raising",
              "an exception or out-of-memory inside the tower", "lower preprocess.token_budget or check the image"),
        Check("assemble.token_tags", "token_tags cover the whole sequence: len(token_tags) == len(input_ids)",
              "tags that misalign every token after the gap", "a layout bug: report it"),
        Check("assemble.loss_mask", "the loss mask covers the sequence, lies on no image token, and (text.train_on "
              "assistant or last_assistant) only on the tokens of assistant turns",
              "a trainer learning to predict the prompt, the system text or image placeholders",
              "a layout bug: report it"),
        Check("assemble.embed_bytes", "embedding bytes == n_tokens * hidden * sizeof(dtype)",
              "a row whose embeddings cannot be reshaped to [n_tokens, hidden]", "a sink bug: report it"),
    ]
}


class CheckFailed(Exception):
    """Raised when a record breaks an invariant. Carries the check, the stage and both sides."""

    def __init__(self, check: str, message: str, expected: object = "", observed: object = "",
                 image_index: int | None = None, turn_index: int | None = None, video_index: int | None = None):
        if check not in CATALOGUE:
            raise KeyError(f"unknown check {check!r}; add it to batchvlm.checks.CATALOGUE")
        super().__init__(f"[{check}] {message}")
        self.check = check
        self.stage = CATALOGUE[check].stage
        self.message = message
        self.expected = str(expected)
        self.observed = str(observed)
        self.image_index = image_index
        self.turn_index = turn_index
        self.video_index = video_index
        self.record = None  # set where a batch-level stage knows which record an image belongs to

    def __reduce__(self):  # crosses process boundaries (decode sandbox, DataLoader workers)
        return (type(self), (self.check, self.message, self.expected, self.observed, self.image_index,
                             self.turn_index, self.video_index))

    def to_failure(self) -> Failure:
        return Failure(check=self.check, stage=self.stage, message=self.message, expected=self.expected,
                       observed=self.observed, exception_type=type(self).__name__, image_index=self.image_index,
                       turn_index=self.turn_index, video_index=self.video_index)


def require(condition: bool, check: str, message: str, expected: object = "", observed: object = "",
            image_index: int | None = None, turn_index: int | None = None) -> None:
    if not condition:
        raise CheckFailed(check, message, expected, observed, image_index, turn_index)


def failure(check: str, message: str, expected: object = "", observed: object = "") -> Failure:
    """The Failure a record is quarantined with where nothing is raised (a row as it is read): the check must be in
    the catalogue, as for CheckFailed."""
    return CheckFailed(check, message, expected, observed).to_failure()


def unexpected_failure(check: str, error: BaseException, image_index: int | None = None) -> Failure:
    """A Failure for an exception that no check anticipated, filed under the stage's catch-all check."""
    return Failure(check=check, stage=CATALOGUE[check].stage, message=f"{type(error).__name__}: {error}",
                   expected="no error", observed=type(error).__name__, exception_type=type(error).__name__,
                   image_index=image_index)


def markdown_table() -> str:
    """The table of checks in docs/checks.md (`python -m batchvlm.checks` prints it)."""
    lines = ["| check | stage | condition | guards against | what to do |", "|---|---|---|---|---|"]
    lines += [f"| `{c.name}` | {c.stage} | {c.condition} | {c.guards_against} | {c.remedy} |" for c in CATALOGUE.values()]
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_table())
