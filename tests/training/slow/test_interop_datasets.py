"""Interop over real runs: rows of `datasets` become the reader's tensors, and MiniMax-H3's and transformers' token
types of real rows."""

from __future__ import annotations

import shutil

import datasets
import pyarrow.parquet as pq
import pytest
import torch
from conftest import committed_shards
from transformers import Qwen2VLForConditionalGeneration

from batchvlm.families import ModelConfig
from batchvlm.families import load_family
from batchvlm.training import DatasetRows, load_run_dataset, minimax_h3_token_types, mm_token_type_ids, pack
from batchvlm.training.reader import read_run

# the image and clip jobs run first, and a (tiny) MiniMax-H3 DiT saved and loaded
pytestmark = pytest.mark.slow


def test_mm_token_type_ids_are_what_transformers_computes_the_stored_positions_from(records):
    family = load_family(ModelConfig(family="qwen2_vl"))
    model = Qwen2VLForConditionalGeneration.from_pretrained(family.checkpoint)
    for record in [r for r in records if len(r.grid_thw)][:4]:
        positions, _ = model.model.get_rope_index(record.input_ids[None], mm_token_type_ids(record.token_tags)[None],
                                                  image_grid_thw=record.grid_thw)
        assert torch.equal(positions[:, 0], record.position_ids), record.id


def _covered(spans: torch.Tensor | None, n: int) -> torch.Tensor:
    """The positions a record's (start, length) spans cover."""
    covered = torch.zeros(n, dtype=torch.bool)
    for start, length in (spans.tolist() if spans is not None else []):
        covered[start:start + length] = True
    return covered


def test_minimax_h3_types_of_real_clip_and_image_rows_and_of_their_pack(clip_run, records):
    clips = list(read_run(clip_run))
    assert any(r.video_spans is not None and not len(r.grid_thw) for r in clips)  # a clip alone
    assert any(r.video_spans is not None and len(r.grid_thw) for r in clips)  # a clip and an image
    for record in clips + [r for r in records if len(r.grid_thw)][:4]:
        n = len(record.token_tags)
        video, image = _covered(record.video_spans, n), _covered(record.image_spans, n)
        if image.any():
            with pytest.raises(ValueError, match=f"no image type .*{int(image.sum())} image token"):
                minimax_h3_token_types(record.token_tags)
        types = minimax_h3_token_types(record.token_tags, images_as_video=True)  # images as conditioning rows
        assert len(types) % 64 == 0 and len(types) - n < 64 and types[n:].eq(-1).all(), record.id
        assert torch.equal(types[:n] == 0, video | image) and types[:n][~(video | image)].eq(1).all(), record.id
        assert torch.equal(mm_token_type_ids(record.token_tags), image.long() + 2 * video.long()), record.id
    alone = [record for record in clips if not len(record.grid_thw)]
    packed = pack(alone, max_tokens=sum(len(r.token_tags) for r in alone))
    types = minimax_h3_token_types(packed.token_tags)
    length = packed.token_tags.shape[1]
    assert len(types) == -(-length // 64) * 64 and types[length:].eq(-1).all()
    assert torch.equal(types[:length], torch.cat([minimax_h3_token_types(r.token_tags)[:len(r.token_tags)]
                                                  for r in alone]))  # pad at the pack's tail only, none between


def test_minimax_h3s_own_forward_takes_the_tags_of_a_real_clip_row(clip_run, tmp_path):
    """diffusers' MiniMaxH3Transformer3DModel checks `token_tags.shape == (seq_len,)` and indexes its per-(timestep,
    modality) AdaLN table with them: our tags of a clip row pass its check and address its video and text rows. Its
    port carries no padding (the reference's -1 tail is split off before it), so the row's tags go unpadded
    (alignment=1)."""
    from diffusers import MiniMaxH3Transformer3DModel

    torch.manual_seed(0)
    MiniMaxH3Transformer3DModel(num_attention_heads=2, attention_head_dim=48, hidden_size=64, num_layers=1,
                                num_refiner_layers=1, ffn_dim=96, in_channels=4, audio_in_channels=4, text_dim=32,
                                freq_dim=32, time_embed_hidden_dim=64, time_embed_dim=32, rope_freq_dim=8
                                ).save_pretrained(tmp_path / "h3")
    model = MiniMaxH3Transformer3DModel.from_pretrained(tmp_path / "h3").eval()
    record = next(r for r in read_run(clip_run) if r.video_spans is not None and not len(r.grid_thw))
    types = minimax_h3_token_types(record.token_tags, alignment=1)
    seq_len = len(types)
    video, text = (types == 0).nonzero()[:, 0], (types == 1).nonzero()[:, 0]
    assert len(video) == int(record.video_spans[:, 1].sum()) and len(video) + len(text) == seq_len
    with torch.no_grad():
        out = model(hidden_states=torch.randn(1, len(video), 16), audio_hidden_states=torch.randn(1, 0, 4),
                    encoder_hidden_states=torch.randn(1, len(text), 32), timestep=torch.tensor([0.5]),
                    timestep_indices=torch.zeros(seq_len, dtype=torch.int64), token_tags=types,
                    position_ids=torch.zeros(seq_len, 3, dtype=torch.int64), video_indices=video,
                    audio_indices=torch.zeros(0, dtype=torch.int64), text_indices=text)
    assert out.sample.shape == (1, len(video), 16) and torch.isfinite(out.sample).all()
    with pytest.raises(ValueError, match="token_tags"):  # its own check: the tags must cover the sequence
        model(hidden_states=torch.randn(1, len(video), 16), audio_hidden_states=torch.randn(1, 0, 4),
              encoder_hidden_states=torch.randn(1, len(text), 32), timestep=torch.tensor([0.5]),
              timestep_indices=torch.zeros(seq_len, dtype=torch.int64), token_tags=types[:-1],
              position_ids=torch.zeros(seq_len, 3, dtype=torch.int64), video_indices=video,
              audio_indices=torch.zeros(0, dtype=torch.int64), text_indices=text)


def assert_same_record(ours, record) -> None:
    """Every tensor equal, the embeddings bit for bit (a NaN or a -0.0 must survive too)."""
    assert ours.id == record.id and ours.rope_delta == record.rope_delta and ours.extras.keys() == record.extras.keys()
    for name in ("input_ids", "grid_thw", "image_spans", "token_tags"):
        assert torch.equal(getattr(ours, name), getattr(record, name)), (record.id, name)
    assert (ours.position_ids is None) == (record.position_ids is None), record.id
    assert ours.position_ids is None or torch.equal(ours.position_ids, record.position_ids), record.id
    embeddings = {"image_embeds": (ours.image_embeds, record.image_embeds),
                  **{name: (ours.extras[name], record.extras[name]) for name in record.extras}}
    for name, (got, stored) in embeddings.items():
        assert got.dtype == stored.dtype and got.shape == stored.shape, (record.id, name)
        assert torch.equal(got.view(torch.uint8), stored.view(torch.uint8)), (record.id, name)


def assert_rows_are_the_runs_records(dataset, records) -> None:
    rows = DatasetRows.from_dataset(dataset)
    read = [rows.tensors(row) for row in dataset]
    assert len(read) == len(records)
    for ours, record in zip(read, records):
        assert_same_record(ours, record)


def without_datasets_key(metadata: dict[bytes, bytes]) -> dict[bytes, bytes]:
    return {key: value for key, value in metadata.items() if key != b"huggingface"}


@pytest.mark.parametrize("run", ["qwen_run", "siglip_run"])
def test_rows_of_load_dataset_become_the_readers_tensors_bit_for_bit_from_the_datasets_features(run, request,
                                                                                              tmp_path):
    run_dir = request.getfixturevalue(run)
    records = list(read_run(run_dir))
    assert any(record.extras for record in records) == (run == "siglip_run")
    dataset = load_run_dataset(run_dir, cache_dir=str(tmp_path / "cache"))
    assert_rows_are_the_runs_records(dataset, records)
    assert_rows_are_the_runs_records(load_run_dataset(run_dir, streaming=True), records)


def test_rows_become_tensors_after_map_select_and_save_to_disk_with_the_run_and_the_cache_gone(qwen_run, records,
                                                                                                tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(qwen_run, run_dir)
    order = list(reversed(range(len(records))))
    dataset = load_run_dataset(run_dir, cache_dir=str(tmp_path / "cache"))
    dataset = dataset.map(lambda row: {"num_tokens": len(row["input_ids"])}).select(order)
    dataset.save_to_disk(str(tmp_path / "saved"))
    shutil.rmtree(run_dir)
    shutil.rmtree(tmp_path / "cache")
    assert_rows_are_the_runs_records(datasets.load_from_disk(str(tmp_path / "saved")), [records[i] for i in order])


@pytest.mark.parametrize("run,kind,embedding_columns", [("qwen_run", "data", ["image_embeds"]),
                                                        ("siglip_run", "data", ["image_embeds", "pooled_embeds",
                                                                                "video_pooled_embeds"]),
                                                        ("qwen_run", "quarantine", [])])
def test_shards_type_no_column_for_datasets_other_than_it_would_infer_and_tag_the_embedding_columns(
        run, kind, embedding_columns, request):
    schema = pq.read_schema(committed_shards(request.getfixturevalue(run), kind)[0])
    meta = schema.metadata
    inferred = datasets.Features.from_arrow_schema(schema.with_metadata(without_datasets_key(meta)))
    features = datasets.Features.from_arrow_schema(schema)
    assert features.arrow_schema == inferred.arrow_schema
    dtype = meta[b"batchvlm.embed_dtype"].decode()
    hidden = {name: int(meta[f"batchvlm.hidden_size.{name}".encode()]) for name in embedding_columns}
    tagged = {name: datasets.Value("large_binary", id=f"batchvlm:embed:{dtype}:{hidden[name]}") for name in hidden}
    assert features == datasets.Features({**inferred, **tagged})


def test_a_dataset_whose_features_lost_an_embedding_layout_is_refused_naming_the_column(siglip_run, tmp_path):
    legacy = tmp_path / "legacy.parquet"  # a shard as written before the huggingface key
    table = pq.read_table(committed_shards(siglip_run)[0])
    pq.write_table(table.replace_schema_metadata(without_datasets_key(table.schema.metadata)), legacy)
    old = datasets.load_dataset("parquet", data_files=[str(legacy)], split="train", cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="column 'image_embeds'.*no batchvlm dtype or hidden size"):
        DatasetRows.from_dataset(old)
    cast = load_run_dataset(siglip_run, cache_dir=str(tmp_path / "cache")).cast_column(
        "pooled_embeds", datasets.Value("large_binary"))
    rows = DatasetRows.from_dataset(cast)
    with pytest.raises(ValueError, match="column 'pooled_embeds'"):
        rows.tensors(next(row for row in cast if row["pooled_embeds"] is not None))
