"""The run's conversations in LLaMA-Factory's and ms-swift's dataset formats, each image a reference to its stored
rows, so that either stack trains on the conversations the job rendered, with the stored features in place of pixels.

One JSON line per written conversation: `{"id", "messages": [{role, content}], "images": [reference, ...]}`, `<image>`
in a content where each image sits (both stacks' tag), a system turn as the first message. That is ms-swift's
`messages`/`images` format as it is, and LLaMA-Factory's ShareGPT format once `dataset_info.json` maps its columns and
role tags (written beside it for format=llamafactory). The conversations come from the data rows (their `text`
column: the turns as the job read them, images as the run's placeholder), so a quarantined record is not exported, a
duplicate the dedup pass left out is not either, and a record `text.overflow=drop_turns` cut keeps only the turns
its row was rendered with.

An image reference names a data shard (one a manifest lists), the row in that shard, and the image in the row:
`data/<shard>.parquet?row=12&image=0`, a path from the run directory (a run and its requeue runs export as one dataset,
as the readers read them; a requeue run's shards are then `../<requeue run>/data/...`). `StoredImages(runs)` turns a
reference into the image's grid and its rows of `image_embeds`: what a stack's plugin or template subclass feeds
instead of pixels (docs/training.md).

A record the stacks would render or mask otherwise than the job did is left out and counted by its reason (SKIPS),
each one named in `skipped.jsonl`; the rules are the stacks' own, read in their sources (docs/training.md).
"""

from __future__ import annotations

import json
import os
import random
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch
import yaml

from batchvlm.config import ConfigError, check_folder_can_be_made
from batchvlm.format.schema import FormatError
from batchvlm.records import Turn
from batchvlm.rundir.layout import DATA, RunLayout
from batchvlm.rundir.manifest import DamagedFile, checked_shards
from batchvlm.sources.conversations import split_placeholders
from batchvlm.training.reader import (RecordTensors, Runs, RunNotFinished, TrustedShard, checked_file,
                                      read_tensor_group, row_group_of, row_group_starts, run_layouts, tensors_of,
                                      trusted_shards)

FORMATS = ("llamafactory", "swift")
STACK_IMAGE_TAG = "<image>"
STACK_MEDIA_TAGS = ("<image>", "<video>", "<audio>")
"""What both stacks read as a media slot wherever it appears in a message's text (LLaMA-Factory's
IMAGE/VIDEO/AUDIO_PLACEHOLDER defaults, ms-swift's Template.special_tokens)."""
SKIPS = {
    "video": "the record holds clips: an export references stored images only, so a stack would get the clip's "
             "<video> tag with no stored rows behind it (and take it for a media slot to load as a file)",
    "roles": "the turns are not an optional system turn, then user and assistant turns in turn, ending with an "
             "assistant turn (LLaMA-Factory drops such an example; ms-swift pairs a query with each response)",
    "empty_system": "the system turn is empty: LLaMA-Factory renders its default system prompt instead, ms-swift none",
    "empty_answer": "an assistant turn is empty: the stacks train its end-of-turn token, the job trains nothing of it",
    "media_tag_in_text": "a turn's text holds <image>, <video> or <audio> (or the run's own placeholder), which the "
                         "stacks would read as a media slot",
    "image_in_answer": "an assistant turn holds an image: LLaMA-Factory trains the whole answer, image tokens too; "
                       "ms-swift trains none of the image's tokens, its frame (<|vision_start|>, <|vision_end|>) "
                       "neither, which the job trains as the answer's",
    "answer_starts_with_newline": "an answer begins with a line break (after optional whitespace): the stacks tokenize "
                                  "an answer apart from its header `assistant\\n`, so the line breaks are tokenized "
                                  "apart too, which the job's rendering (one tokenization) merges",
    "round_field_in_text": "(ms-swift) a user text holds {{ROUND0}} or {{ROUND1}}, which its template replaces by the "
                           "round's number",
    "control_string_in_text": "(a run with text.control_tokens=text) a text holds a string of a special token's shape "
                              "(<|...|>): the job tokenized it as plain text, the stacks tokenize a special token's "
                              "string as the special token",
}
"""Why a conversation is not exported: reason -> what the stack would do with it."""
SKIPPED = "skipped"
"""The stem of the file naming each conversation left out and why."""
REFERENCE = re.compile(r"^(?P<shard>[^?]+\.parquet)\?row=(?P<row>[0-9]+)&image=(?P<image>[0-9]+)$")
"""A data shard's path from the (first) run directory, the row in it, the image in the row."""


@dataclass(frozen=True)
class ImageReference:
    """An image of a written record: the data shard (its path from the first run directory: `data/<file>`, or
    `../<requeue run>/data/<file>`), the record's row in it, the image."""

    shard: str
    row: int
    image: int

    def __str__(self) -> str:
        return f"{self.shard}?row={self.row}&image={self.image}"

    @classmethod
    def of(cls, reference: ImageReference | str) -> ImageReference:
        return cls.parse(reference) if isinstance(reference, str) else reference

    @classmethod
    def parse(cls, text: str) -> ImageReference:
        match = REFERENCE.match(text) if isinstance(text, str) else None
        if match is None:
            raise ValueError(f"{text!r} is not a batchvlm image reference (data/<shard>.parquet?row=<n>&image=<k>)")
        return cls(match["shard"], int(match["row"]), int(match["image"]))


@dataclass
class ExportSummary:
    out: Path
    files: list[Path]
    exported: int = 0
    skipped: Counter = field(default_factory=Counter)


def run_setting(layout: RunLayout, key: str):
    """A value of the config the run was started with (`dataset.format`), None where it does not say."""
    node = yaml.safe_load(layout.config.read_text()) if layout.config.exists() else None
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def conversation_turns(text: str, placeholder: str, kept: int) -> list[Turn]:
    """The first `kept` turns of a data row's `text` (the turns as JSON, each image as the run's placeholder)."""
    return [Turn(turn["role"], split_placeholders(turn["content"], placeholder)) for turn in json.loads(text)[:kept]]


CONTROL_STRING = re.compile(r"<\|[^|<>\s]+\|>")
"""The shape of the Qwen and Kimi tokenizers' special tokens (`<|im_end|>`, `<|media_pad|>`)."""
SWIFT_ROUND_FIELDS = ("{{ROUND0}}", "{{ROUND1}}")
"""What ms-swift's template fills in a user turn's text after the text is put in (its _concat_context_list)."""


def skip_reason(turns: list[Turn], num_images: int, format: str, control_as_text: bool = False,
                num_videos: int = 0) -> str | None:
    """Why the stacks would not train this conversation as the job rendered it (a key of SKIPS), or None.
    `control_as_text`: the run tokenized control strings in texts as plain text (text.control_tokens=text; otherwise
    a written record holds none). `num_videos`: the record's stored clips."""
    if num_videos:
        return "video"
    roles = [turn.role for turn in turns]
    body = roles[1:] if roles[:1] == ["system"] else roles
    if not body or len(body) % 2 or body != ["user", "assistant"] * (len(body) // 2):
        return "roles"
    if roles[0] == "system" and not "".join(part for part in turns[0].content if part is not None):
        return "empty_system"
    texts = [part for turn in turns for part in turn.content if part is not None]
    if sum(turn.num_images for turn in turns) != num_images or any(tag in text for text in texts
                                                                   for tag in STACK_MEDIA_TAGS):
        return "media_tag_in_text"
    answers = [turn for turn in turns if turn.role == "assistant"]
    if any(not turn.content for turn in answers):
        return "empty_answer"
    if any(turn.num_images for turn in answers):
        return "image_in_answer"
    if any(re.match(r"\s*[\r\n]", turn.content[0] or "") for turn in answers):
        return "answer_starts_with_newline"
    if control_as_text and any(CONTROL_STRING.search(text) for text in texts):
        return "control_string_in_text"
    if format == "swift" and any(field in part for turn in turns if turn.role == "user" for part in turn.content
                                 if part is not None for field in SWIFT_ROUND_FIELDS):
        return "round_field_in_text"
    return None


def exported_line(record_id: str, turns: list[Turn], references: list[ImageReference]) -> dict:
    """A conversation in the stacks' `messages`/`images` form."""
    messages = [{"role": turn.role, "content": turn.text(STACK_IMAGE_TAG)} for turn in turns]
    return {"id": record_id, "messages": messages, "images": [str(reference) for reference in references]}


def dataset_info(name: str, file_name: str) -> dict:
    """LLaMA-Factory's description of the exported file: ShareGPT formatting, the columns and role tags it uses."""
    return {name: {"file_name": file_name, "formatting": "sharegpt",
                   "columns": {"messages": "messages", "images": "images"},
                   "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                            "assistant_tag": "assistant", "system_tag": "system"}}}


def check_exportable(runs: Runs, format: str, out: Path, name: str | None = None,
                     shuffle_seed: int | None = None) -> list[TrustedShard]:
    """Bad arguments, before anything is written: ConfigError naming the key. The shards the readers read of the run
    (or of a run and its requeue runs, as read_run takes them)."""
    if format not in FORMATS:
        raise ConfigError(f"format must be one of {', '.join(FORMATS)}, not {format!r}")
    if shuffle_seed is not None and (not isinstance(shuffle_seed, int) or isinstance(shuffle_seed, bool)):
        raise ConfigError(f"shuffle_seed must be an integer or null, not {shuffle_seed!r}")
    if name is not None and (not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", str(name)) or name == SKIPPED):
        raise ConfigError(f"name must be a plain file stem (letters, digits, _ . -) other than {SKIPPED!r}, not "
                          f"{name!r}")
    named = [runs] if isinstance(runs, (str, Path)) else list(runs)
    if not named:
        raise ConfigError("run_dir names no run: run_dir=outputs/<run> or [outputs/<run>, outputs/<requeue run>]")
    if any(not str(run).strip() for run in named):  # Path("") is the current folder, which no one named
        raise ConfigError(f"run_dir holds an empty path: {named}")
    run_dir = first_run(runs)
    layout = RunLayout(run_dir)
    if not layout.config.exists():
        raise ConfigError(f"run_dir: {run_dir} is not a batchvlm run directory (no {layout.name_of(layout.config)})")
    if run_setting(layout, "dataset.format") in (None, "text"):
        raise ConfigError(f"run_dir: {run_dir} holds plain texts (dataset.format=text), not conversations: there is "
                          "nothing to export in a chat format")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"out: {out} already exists and is not an empty folder (an export never writes over files)")
    check_folder_can_be_made("out", out)
    try:
        return trusted_shards(runs)
    except (RunNotFinished, FormatError, DamagedFile, ValueError) as error:  # runs the readers refuse: before `out`
        raise ConfigError(f"run_dir: {error}") from None


def first_run(runs: Runs) -> Path:
    return Path(runs if isinstance(runs, (str, Path)) else runs[0])


def shard_name(first: Path, path: Path) -> str:
    """A shard's path from the first run directory: what a reference names."""
    return Path(os.path.relpath(path, first)).as_posix()


def row_groups(shards: list[TrustedShard], shuffle_seed: int | None) -> list[tuple[TrustedShard, int, int]]:
    """(shard, row group, its first row in the shard) of every row group, in the run's order or, with a seed, in an
    order drawn from it: from the files' metadata, without reading a row."""
    groups = []
    for shard in shards:
        starts = row_group_starts(checked_file(shard.path))
        groups += [(shard, g, int(starts[g])) for g in range(len(starts) - 1)]
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(groups)
    return groups


CONVERSATION_COLUMNS = ["id", "row", "text", "turns", "grid_thw", "video_grid_thw"]
"""What an exported line and its skip reason are made of: no embedding is read."""


def conversations(first: Path, shards: list[TrustedShard], format: str,
                  shuffle_seed: int | None = None) -> Iterator[tuple[str, str | None, dict | None]]:
    """(id, skip reason, exported line) of every record the readers read, a row group at a time: in the run's order,
    or with `shuffle_seed` the row groups in a drawn order and each group's records shuffled (a stack reading the
    file in order then reads each group's stored rows once, the records mixed across the run)."""
    draw = random.Random(shuffle_seed)
    runs = {shard.run.root: shard.run for shard in shards}.values()
    settings = {run.root: (run_setting(run, "dataset.placeholder") or STACK_IMAGE_TAG,
                           run_setting(run, "text.control_tokens") == "text") for run in runs}
    open_path = file = None
    for shard, group, at in row_groups(shards, shuffle_seed):
        placeholder, control_as_text = settings[shard.run.root]
        name = shard_name(first, shard.path)
        if shard.path != open_path:  # in the run's order each shard is opened once; one file is open at a time
            open_path, file = shard.path, checked_file(shard.path)
        table = file.read_row_group(group, columns=CONVERSATION_COLUMNS)
        rows = list(enumerate(table.to_pylist(), at))
        if shuffle_seed is not None:
            draw.shuffle(rows)
        for index, row in rows:
            if row["row"] in shard.skipped:
                continue
            turns = conversation_turns(row["text"], placeholder, len(row["turns"] or ()))
            reason = skip_reason(turns, len(row["grid_thw"]), format, control_as_text,
                                 len(row["video_grid_thw"] or ()))
            references = [ImageReference(name, index, k) for k in range(len(row["grid_thw"]))]
            yield row["id"], reason, None if reason else exported_line(row["id"], turns, references)


def export_run(runs: Runs, format: str, out: str | Path, name: str | None = None,
               shuffle_seed: int | None = None) -> ExportSummary:
    """Write the conversations of a run (or of a run and its requeue runs, read as one dataset) to `out` (a new folder)
    in `format`, in the runs' order or shuffled by row group (`conversations`); files appear under their names once
    whole."""
    out = Path(out)
    shards = check_exportable(runs, format, out, name, shuffle_seed)
    name = name or re.sub(r"[^A-Za-z0-9_.-]", "_", first_run(runs).resolve().name)
    out.mkdir(parents=True, exist_ok=True)
    data = out / f"{name}.jsonl"
    summary = ExportSummary(out, [data, out / f"{SKIPPED}.jsonl"])
    with open(f"{data}.partial", "w") as lines, open(f"{summary.files[1]}.partial", "w") as skipped:
        for record_id, reason, line in conversations(first_run(runs), shards, format, shuffle_seed):
            if reason:
                skipped.write(json.dumps({"id": record_id, "reason": reason}, ensure_ascii=False) + "\n")
                summary.skipped[reason] += 1
            else:
                lines.write(json.dumps(line, ensure_ascii=False) + "\n")
                summary.exported += 1
    if format == "llamafactory":
        info = out / "dataset_info.json"
        Path(f"{info}.partial").write_text(json.dumps(dataset_info(name, data.name), indent=2) + "\n")
        summary.files.append(info)
    for path in summary.files:
        os.replace(f"{path}.partial", path)
    return summary


class StoredImages:
    """The stored rows behind exported image references: each image's grid (t, h, w) and its rows of image_embeds, read
    from the shards the run's manifests list (a reference to any other file is refused). A reference is read with its
    row group (up to 64 MB), one group kept at a time: references in the exported file's order read each group once
    (export with shuffle_seed for a shuffled order that keeps this); in a random order an image may cost a read of
    its group."""

    def __init__(self, runs: Runs):
        first = first_run(runs)
        self.shards = {shard_name(first, path): path for layout in run_layouts(runs)
                       for _, path in checked_shards(layout, DATA)}
        self._starts: dict[str, np.ndarray] = {}
        self._group: tuple[str, int, object] | None = None

    def record(self, reference: ImageReference | str) -> RecordTensors:
        """The written record a reference points into."""
        reference = ImageReference.of(reference)
        if reference.shard not in self.shards:
            raise ValueError(f"{reference} names {reference.shard}, which no manifest of the run lists")
        if reference.shard not in self._starts:
            self._starts[reference.shard] = row_group_starts(pq.ParquetFile(self.shards[reference.shard]))
        starts = self._starts[reference.shard]
        if (group := row_group_of(starts, reference.row)) is None:
            raise ValueError(f"{reference} names row {reference.row}; {reference.shard} has {starts[-1]} rows")
        if self._group is None or self._group[:2] != (reference.shard, group):
            self._group = (reference.shard, group, read_tensor_group(self.shards[reference.shard], group))
        return tensors_of(self._group[2], reference.row - int(starts[group]))

    def image(self, reference: ImageReference | str) -> tuple[torch.Tensor, torch.Tensor]:
        """(grid_thw [3], image_embeds rows [tokens, hidden]) of one referenced image."""
        reference = ImageReference.of(reference)
        record = self.record(reference)
        if reference.image >= len(record.grid_thw):
            raise ValueError(f"{reference} names image {reference.image}; record {record.id!r} has "
                             f"{len(record.grid_thw)}")
        lengths = record.image_spans[:, 1].tolist()
        start = sum(lengths[:reference.image])
        return record.grid_thw[reference.image], record.image_embeds[start:start + lengths[reference.image]]

    def images(self, references: list[ImageReference | str]) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """(image_grid_thw [n, 3], one image_embeds tensor per image): a batch's images, in its order, as a model's
        `image_grid_thw` and `mm_encoder_outputs={"image": BaseModelOutputWithPooling(pooler_output=...)}` take them."""
        grids, embeds = zip(*(self.image(reference) for reference in references)) if references else ((), ())
        return (torch.stack(grids) if grids else torch.zeros((0, 3), dtype=torch.int64)), tuple(embeds)
