"""The output contract: every column of a data or a quarantine shard, declared once (name, Arrow type, meaning, who
writes it), and the output format's version. Everything else is taken from the declarations: the writer's schemas
(DATA_SCHEMA, QUARANTINE_SCHEMA), the check that a row has exactly the declared keys (`check_row`: the sink runs it on
every row), the columns the readers take (TENSOR_COLUMNS, EXTRA_OUTPUTS) and the column tables of docs/output.md
(`column_table`, which a test compares with the page).
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

import batchvlm
from batchvlm.config import Choice

FORMAT_VERSION = 4
"""The output format: a run directory's marker and every data and quarantine shard's schema metadata carry it
(FORMAT_KEY). 1 is every run written before the format had a version, 2 every run written before clips, 3 every run
written before Qwen3-VL clips (video_deepstack_embeds); rundir/upgrade.py brings one up to this."""
FORMAT_KEY = "batchvlm.format_version"

TEXT, IMAGE, FRAME = 0, 1, 2
"""token_tags values: text, an image-embedding position, a frame token around an image's span."""
VIDEO = 3
"""The token_tags value of a clip-embedding position (Qwen2/2.5-VL's `<|video_pad|>`)."""


class Dtype(Choice):
    """A tower's compute dtype, and the stored embeddings' (model.dtype, output.embed_dtype)."""

    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


def __getattr__(name: str):
    """EMBED_DTYPES (torch's dtype of each Dtype), made when first asked for (PEP 562): the commands that read a run's
    metadata alone (`status`, `verify`) import this module and need not import torch."""
    if name == "EMBED_DTYPES":
        import torch

        globals()[name] = {Dtype.bfloat16: torch.bfloat16, Dtype.float16: torch.float16, Dtype.float32: torch.float32}
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


EVERY_RECORD = "every record"


@dataclass(frozen=True)
class Column:
    """One column of a shard: its name and Arrow type, what it means, and which records write it (`written_by`:
    every record, else the families or modes that do; the others hold a null)."""

    name: str
    type: pa.DataType
    meaning: str
    written_by: str = EVERY_RECORD
    read: bool = False
    """Whether the training readers take it (training.reader: read_run, the loader, `datasets` rows)."""
    embedding: bool = False
    """Raw little-endian embedding bytes, [rows, hidden] of output.embed_dtype (the hidden size in the metadata)."""

    @property
    def required(self) -> bool:
        return self.written_by == EVERY_RECORD

    def field(self) -> pa.Field:
        """Nullable in the Arrow schema whoever writes it: `datasets` takes a column's feature from the shard's own key
        only where the types match to the nullability (hf_features), and the row check holds the required ones."""
        return pa.field(self.name, self.type)


_SIZE = pa.list_(pa.int32(), 2)
CONVERSATION = "a conversation (`dataset.format` other than text)"
CLIPS = "a record with clips (qwen2_vl: Qwen2-VL, Qwen2.5-VL, Qwen3-VL; kimi_k25; siglip2)"

DATA_COLUMNS = (
    Column("id", pa.string(), "the dataset's own id", read=True),
    Column("source", pa.string(), "the input file (or dataset) the record was read from"),
    Column("row", pa.int64(), "the record's row in its input"),
    Column("text", pa.string(), "the original text; a conversation's turns as JSON (`[{role, content}]`, images as "
           "the placeholder)"),
    Column("input_ids", pa.list_(pa.int32()), "token ids with each placeholder expanded (the checkpoint's tokenizer; "
           "a conversation: rendered with its chat template)", read=True),
    Column("image_spans", pa.list_(pa.struct([("start", pa.int32()), ("length", pa.int32())])),
           "each image's run of image tokens in `input_ids`", read=True),
    Column("token_tags", pa.list_(pa.int8()), "per token: 0 text, 1 image token, 2 frame token, 3 video token",
           read=True),
    Column("num_tokens", pa.int32(), "`len(input_ids)`: what the loader reads at start-up"),
    Column("loss_mask", pa.list_(pa.int8()), "1 where a trainer learns the token (`text.train_on`)", CONVERSATION,
           read=True),
    Column("turns", pa.list_(pa.struct([("role", pa.string()), ("start", pa.int32()), ("end", pa.int32())])),
           "each turn's tokens `[start, end)` in `input_ids`, its end-of-turn token last", CONVERSATION),
    Column("dropped_turns", pa.int32(), "trailing turns `text.overflow=drop_turns` left out", CONVERSATION),
    Column("grid_thw", pa.list_(pa.list_(pa.int32(), 3)), "per image (t, h, w) in patches", read=True),
    Column("original_size", pa.list_(_SIZE), "per image (height, width) as decoded, upright"),
    Column("resized_size", pa.list_(_SIZE), "per image (height, width) after the family's resize"),
    Column("image_sha256", pa.list_(pa.string()), "per image, the digest of its original bytes"),
    Column("image_num_tokens", pa.list_(pa.int32()), "per image, its LLM tokens"),
    Column("num_image_tokens", pa.int32(), "the record's image tokens in all"),
    Column("image_embeds", pa.large_binary(), "all images' tokens in span order, `[num_image_tokens, hidden]`",
           read=True, embedding=True),
    Column("tower_embeds", pa.large_binary(), "the tower's features before the projector, grouped per LLM token, "
           "`[num_image_tokens, hidden.tower_embeds]`", "`model.embedding=both`", read=True, embedding=True),
    Column("pooled_embeds", pa.large_binary(), "one pooled vector per image (the attention-pooling head), "
           "`[n_images, hidden]`", "siglip2", read=True, embedding=True),
    Column("deepstack_embeds", pa.large_binary(), "the deepstack layers' merged features per LLM token, the layers "
           "concatenated along hidden", "qwen2_vl (Qwen3-VL)", read=True, embedding=True),
    Column("position_ids", pa.list_(pa.list_(pa.int32())), "M-RoPE (t, h, w) position of every token: 3 lists of "
           "`num_tokens`", "qwen2_vl", read=True),
    Column("rope_delta", pa.int32(), "max position + 1 - sequence length (where decoding continues)", "qwen2_vl",
           read=True),
    Column("video_spans", pa.list_(pa.struct([("start", pa.int32()), ("length", pa.int32())])),
           "each clip's run of video tokens in `input_ids`, in clip order (Qwen3-VL: one run per temporal patch, "
           "after its timestamp; Kimi-K2.5: one per chunk)", CLIPS, read=True),
    Column("video_grid_thw", pa.list_(pa.list_(pa.int32())), "per clip (Kimi-K2.5: per chunk) (t, h, w) in patches "
           "(transformers' `video_grid_thw`)", CLIPS, read=True),
    Column("second_per_grid_ts", pa.list_(pa.float64()), "per clip, the seconds one temporal patch spans: "
           "temporal_patch_size / the sampled frame rate (Qwen2.5-VL's M-RoPE time step, with tokens_per_second); null "
           "for Kimi-K2.5, whose chunks' times are text",
           CLIPS, read=True),
    Column("video_num_tokens", pa.list_(pa.int32()), "per clip (Kimi-K2.5: per chunk), its LLM tokens", CLIPS),
    Column("video_frame_indices", pa.list_(pa.list_(pa.int32())), "per clip, the sampled frames' positions among its "
           "frames (presentation order)", CLIPS),
    Column("video_frame_times", pa.list_(pa.list_(pa.float64())), "per clip, the sampled frames' times in seconds "
           "from its first frame (from their pts)", CLIPS),
    Column("video_embeds", pa.large_binary(), "all clips' tokens in span order, `[sum(video_num_tokens), hidden]` "
           "(the hidden size of `image_embeds`)", CLIPS, read=True, embedding=True),
    Column("video_deepstack_embeds", pa.large_binary(), "the deepstack layers' merged features per clip token, as "
           "`deepstack_embeds` per image token (its hidden size)", "qwen2_vl (Qwen3-VL) with clips", read=True,
           embedding=True),
    Column("video_pooled_embeds", pa.large_binary(), "one pooled vector per sampled frame of every clip, in clip "
           "order, `[sum(frames), hidden]` (the hidden size of `pooled_embeds`)", "siglip2 clips", read=True,
           embedding=True),
)
"""A data shard's row: one per record written."""


QUARANTINE_COLUMNS = (
    Column("id", pa.string(), "the dataset's own id (`<input>#<row>` where it has none: source.missing_id)"),
    Column("source", pa.string(), "the input the record was read from"),
    Column("row", pa.int64(), "the record's row in its input"),
    Column("unit", pa.string(), "the work unit it was read in"),
    Column("stage", pa.string(), "the stage whose check failed (source, decode, text, preprocess, encode, assemble)"),
    Column("check", pa.string(), "the check that failed (docs/checks.md)"),
    Column("message", pa.string(), "what the check says, naming the record's values"),
    Column("expected", pa.string(), "what the check expected"),
    Column("observed", pa.string(), "what it found"),
    Column("exception_type", pa.string(), "the exception behind the failure (CheckFailed for a check's own)"),
    Column("image_index", pa.int32(), "the image the failure is about", "a failure about one image"),
    Column("video_index", pa.int32(), "the clip the failure is about (`video.*`, a clip's span or rows)",
           "a failure about one clip"),
    Column("image_bytes", pa.list_(pa.large_binary()), "per image, its original bytes up to "
           "`output.quarantine_bytes_cap` (else null)"),
    Column("image_paths", pa.list_(pa.string()), "per image, the path it was read from (null for bytes)"),
    Column("video_paths", pa.list_(pa.string()), "per clip, the path it was read from (null for bytes)",
           "a record that names clips"),
    Column("text", pa.string(), "the record's text as read (a conversation's turns as JSON)"),
    Column("turns", pa.list_(pa.struct([("role", pa.string()), ("text", pa.string())])),
           "a conversation's turns as read, images as the placeholder", CONVERSATION),
    Column("turn_index", pa.int32(), "the turn the failure is about (`text.too_long`: where `text.max_tokens` falls)",
           "a failure about one turn"),
    Column("fingerprint", pa.string(), "the run's fingerprint digest"),
)
"""A quarantine shard's row: one per record quarantined, with its evidence."""


class RowError(ValueError):
    """A row that does not have the declared columns: a misspelt key would otherwise be a silent column of nulls."""


class Shard:
    """One kind of shard as the contract declares it: its columns, and from them its Arrow schema and its row check."""

    def __init__(self, columns: tuple[Column, ...]):
        self.columns = columns
        self.schema = pa.schema([column.field() for column in columns])
        self.names = frozenset(column.name for column in columns)
        self.required = tuple(column.name for column in columns if column.required)

    def check_row(self, row: dict) -> None:
        """The row has exactly the declared keys, and a value in every column every record writes (RowError naming
        the record and the keys)."""
        if row.keys() != self.names:
            extra, missing = sorted(row.keys() - self.names), sorted(self.names - row.keys())
            found = [f"undeclared {', '.join(extra)}" if extra else "",
                     f"missing {', '.join(missing)}" if missing else ""]
            raise RowError(f"row of {row.get('id')!r}: {'; '.join(part for part in found if part)} (the columns are "
                           "declared in batchvlm.format.schema)")
        if empty := [name for name in self.required if row[name] is None]:
            raise RowError(f"row of {row.get('id')!r}: no value in {', '.join(empty)}, which every record writes")


DATA_SHARD, QUARANTINE_SHARD = Shard(DATA_COLUMNS), Shard(QUARANTINE_COLUMNS)
DATA_SCHEMA, QUARANTINE_SCHEMA = DATA_SHARD.schema, QUARANTINE_SHARD.schema

EXTRA_OUTPUTS = {column.name: column.meaning for column in DATA_COLUMNS
                 if column.embedding and column.name not in ("image_embeds", "video_embeds")}
"""Outputs an encoder may return beside `image_embeds`; each is stored in its own column. A `video_` one holds the
clips' share of the output it names (video_deepstack_embeds: deepstack_embeds', video_pooled_embeds: pooled_embeds'),
as wide as the images'."""


def image_counterpart(name: str) -> str:
    """The encoder output whose width a column has: a clip column's (`video_<name>`) is its image counterpart's."""
    return name.removeprefix("video_")


def clip_column(output: str) -> str | None:
    """The column a clip's share of an encoder output goes to (`video_<output>`), where the contract declares one."""
    column = f"video_{output}"
    return column if column in EXTRA_OUTPUTS else None


def stored_sizes(hidden_sizes: dict[str, int]) -> dict[str, int]:
    """The hidden size of every embedding column the encoder's outputs fill: its outputs', and their clip columns'."""
    return hidden_sizes | {column: size for name, size in hidden_sizes.items() if (column := clip_column(name))}


TENSOR_COLUMNS = tuple(column.name for column in DATA_COLUMNS if column.read)
"""The columns the training readers take; a reader that only wants tensors need not read the others."""


def shard_metadata(family: str, hidden_sizes: dict[str, int], embed_dtype: str, embedding: str,
                   fingerprint: str) -> dict[str, str]:
    """Every shard's schema metadata: the format version, and what a reader needs to turn the embedding bytes into
    tensors. The `huggingface` key repeats the embedding columns' dtype and hidden sizes for `datasets`, which keeps
    no other key (hf_features); a quarantine shard has none of those columns, and `datasets` ignores what the key says
    of columns a file lacks."""
    from batchvlm.format.hf_features import SIZE_KEY, features_key

    hidden_sizes = stored_sizes(hidden_sizes)
    sizes = {f"{SIZE_KEY}{name}": str(size) for name, size in hidden_sizes.items()}
    return {FORMAT_KEY: str(FORMAT_VERSION), **sizes, "batchvlm.family": family,
            "batchvlm.hidden_size": str(hidden_sizes["image_embeds"]), "batchvlm.embed_dtype": str(embed_dtype),
            "batchvlm.embedding": str(embedding), "batchvlm.fingerprint": fingerprint,
            "batchvlm.version": batchvlm.__version__, "huggingface": features_key(hidden_sizes, str(embed_dtype))}


class FormatError(ValueError):
    """Output this batchvlm cannot read: written in a newer format, or in an older one that is to be upgraded."""


def format_of(metadata: dict | None) -> int:
    """The format version a shard's schema metadata gives (1: written before the format had one)."""
    value = (metadata or {}).get(FORMAT_KEY.encode())
    return int(value) if value is not None else 1


def check_format(version: int, where: str) -> None:
    """FormatError naming `where` unless it is written in the format this batchvlm reads."""
    if version > FORMAT_VERSION:
        raise FormatError(f"{where} is written in output format {version}, by a newer batchvlm; this one (batchvlm "
                          f"{batchvlm.__version__}) reads format {FORMAT_VERSION}: upgrade batchvlm to read it")
    if version < FORMAT_VERSION:
        raise FormatError(f"{where} is written in output format {version}; this batchvlm reads format "
                          f"{FORMAT_VERSION}: upgrade the run directory once with `batchvlm-upgrade run_dir=<run>`")


def column_table(columns: tuple[Column, ...]) -> str:
    """The columns as the Markdown table docs/output.md shows (a test holds the page to it)."""
    lines = ["| column | type | written by | meaning |", "|---|---|---|---|"]
    lines += [f"| `{column.name}` | {type_name(column.type)} | {column.written_by} | {column.meaning} |"
              for column in columns]
    return "\n".join(lines)


def type_name(kind: pa.DataType) -> str:
    """An Arrow type as a reader writes it: list<list<int32>[3]>, struct<start: int32, length: int32>."""
    if pa.types.is_fixed_size_list(kind):
        return f"list<{type_name(kind.value_type)}>[{kind.list_size}]"
    if pa.types.is_list(kind):
        return f"list<{type_name(kind.value_type)}>"
    if pa.types.is_struct(kind):
        fields = [kind.field(i) for i in range(kind.num_fields)]
        return f"struct<{', '.join(f'{field.name}: {type_name(field.type)}' for field in fields)}>"
    return str(kind)


if __name__ == "__main__":  # the tables of docs/output.md
    print(column_table(DATA_COLUMNS), column_table(QUARANTINE_COLUMNS), sep="\n\n")
