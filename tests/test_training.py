"""The training loader on a real run (the Qwen2-VL demo, bf16 as the job writes it by default): packed batches
that add up, every record once per epoch over ranks and workers, a seeded shuffle, exact resume; interop."""

from __future__ import annotations

import shutil
from dataclasses import replace
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import run_embed
from transformers import Qwen2VLForConditionalGeneration

from batchvlm.bench.tasks import BenchConfig, bench_loader, format_loader
from batchvlm.config import ModelConfig
from batchvlm.families import load_family
from batchvlm.training.reader import committed_shards, read_run, table_tensors, tensors_of
from batchvlm.format.schema import IMAGE
from batchvlm.training import (IGNORE_INDEX, DatasetRows, LoaderConfig, PackedLoader, PackingError, RunNotFinished,
                               first_fit_decreasing, load_run_dataset, mm_token_type_ids, pack,
                               vllm_qwen2_vl_image_input)
from batchvlm.training.loader import READ_AHEAD, _OpenShards
from batchvlm.training.packing import check_packed

SMALL = LoaderConfig(max_tokens=800, shuffle_buffer=4, pack_buffer=8, num_workers=0)


@pytest.fixture(scope="module")
def qwen_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("outputs")
    result = run_embed(f"output.root={root}", "run_name=qwen", "model=qwen2_vl_tiny")
    assert result.returncode == 0, result.stderr[-3000:]
    return root / "qwen"


@pytest.fixture(scope="module")
def records(qwen_run):
    return list(read_run(qwen_run))


def ids_of(batches) -> list[list[str]]:
    return [batch.ids for batch in batches]


def pack_ids(loader: PackedLoader, packs) -> list[list[str]]:
    """The record ids of planned packs, read from the shards' id column alone."""
    ids = [pq.read_table(path, columns=["id"]).column("id").to_pylist() for path in loader.index.shards]
    return [[ids[shard][row] for shard, row in refs] for refs in packs]


def test_first_fit_decreasing_puts_the_longest_first_into_the_first_bin_with_room():
    assert first_fit_decreasing([5, 7, 3, 2, 4], capacity=10) == [[1, 2], [0, 4], [3]]


@pytest.mark.slow
def test_a_packed_batch_covers_its_length_with_restarted_positions_and_masked_labels(records):
    chosen = [r for r in records if r.id in ("astronaut", "text_only", "cat_and_coffee")]
    batch = pack(chosen, max_tokens=2048)
    lengths = [len(r.input_ids) for r in chosen]
    assert batch.cu_seqlens.tolist() == [0, lengths[0], lengths[0] + lengths[1], sum(lengths)]
    assert batch.position_ids.shape == (4, 1, sum(lengths)) and batch.max_seqlen == max(lengths)
    for index, (record, start) in enumerate(zip(chosen, batch.cu_seqlens.tolist())):
        segment = slice(start, start + len(record.input_ids))
        assert batch.position_ids[0, 0, segment].tolist() == list(range(len(record.input_ids)))
        assert torch.equal(batch.position_ids[1:, 0, segment], record.position_ids)
        assert (batch.document_ids[0, segment] == index).all()
        labels = batch.labels[0, segment]
        assert labels[0] == IGNORE_INDEX
        assert torch.equal(labels[1:] == IGNORE_INDEX, record.token_tags[1:] == IMAGE)
    assert torch.equal(batch.input_ids[0, batch.image_positions], torch.cat([
        r.input_ids[r.image_token_positions()] for r in chosen]))
    assert torch.equal(batch.image_embeds, torch.cat([r.image_embeds for r in chosen]))


@pytest.mark.slow
def test_a_packed_batch_moves_every_tensor_to_the_device(records):
    batch = pack(records[:3], max_tokens=2048).to("meta")
    tensors = [v for v in vars(batch).values() if isinstance(v, torch.Tensor)] + list(batch.extras.values())
    assert len(tensors) >= 9 and all(t.device.type == "meta" for t in tensors)


@pytest.mark.slow
def test_a_batch_that_does_not_add_up_is_refused(records):
    batch = pack(records[:3], max_tokens=2048)
    unrestarted = batch.position_ids.clone()
    unrestarted[0, 0] = torch.arange(batch.num_tokens)
    with pytest.raises(PackingError, match="restart"):
        check_packed(replace(batch, position_ids=unrestarted), 2048)
    with pytest.raises(PackingError, match="token_tags must cover"):
        check_packed(replace(batch, token_tags=batch.token_tags[:, 1:]), 2048)
    with pytest.raises(PackingError, match="cu_seqlens"):
        check_packed(replace(batch, cu_seqlens=batch.cu_seqlens[:-1]), 2048)
    with pytest.raises(PackingError, match="image_embeds rows"):
        check_packed(replace(batch, image_embeds=batch.image_embeds[1:]), 2048)
    with pytest.raises(PackingError, match="max_tokens"):
        pack(records[:3], max_tokens=batch.num_tokens - 1)


@pytest.mark.slow
def test_a_run_without_success_is_refused_unless_asked(qwen_run, tmp_path):
    unfinished = tmp_path / "unfinished"
    shutil.copytree(qwen_run, unfinished)
    (unfinished / "_SUCCESS").unlink()
    with pytest.raises(RunNotFinished, match="_SUCCESS"):
        PackedLoader(unfinished, SMALL)
    assert len(PackedLoader(unfinished, replace(SMALL, allow_unfinished=True))) > 0


@pytest.mark.slow
def test_ranks_and_workers_together_read_every_record_once_per_epoch(qwen_run, records):
    config = replace(SMALL, num_workers=2)
    ranks = [PackedLoader(qwen_run, config, rank=r, world_size=2) for r in range(2)]
    packs = pack_ids(ranks[0], ranks[0].epoch_packs())
    read = [ids_of(loader) for loader in ranks]
    assert len(read[0]) == len(read[1]) == len(packs) // 2
    assert read[0] == packs[0:len(packs) // 2 * 2:2] and read[1] == packs[1:len(packs) // 2 * 2:2]
    seen = [i for rank in read for batch in rank for i in batch]
    dropped = packs[len(packs) // 2 * 2:]  # the tail that would leave one rank a batch short
    assert sorted(seen + sum(dropped, [])) == sorted(r.id for r in records)


@pytest.mark.slow
def test_the_shuffle_is_fixed_by_the_seed_and_changes_with_the_epoch(qwen_run):
    first, again = PackedLoader(qwen_run, SMALL), PackedLoader(qwen_run, SMALL)
    epoch0 = ids_of(first)
    assert ids_of(again) == epoch0
    epoch1 = ids_of(first)
    assert first.epoch == 2 and epoch1 != epoch0
    assert sorted(sum(epoch1, [])) == sorted(sum(epoch0, []))
    assert ids_of(PackedLoader(qwen_run, replace(SMALL, seed=1))) != epoch0


@pytest.mark.slow
def test_state_dict_resumes_mid_epoch_exactly(qwen_run):
    config = replace(SMALL, num_workers=2)
    straight = PackedLoader(qwen_run, config)
    expected = ids_of(straight) + ids_of(straight)
    interrupted = PackedLoader(qwen_run, config)
    taken = []
    for batch in interrupted:
        taken.append(batch.ids)
        if len(taken) == 2:
            break
    resumed = PackedLoader(qwen_run, config)
    resumed.load_state_dict(interrupted.state_dict())
    assert taken + ids_of(resumed) + ids_of(resumed) == expected


@pytest.mark.slow
def test_resume_under_another_world_size_deals_the_remaining_packs_once(qwen_run):
    two = [PackedLoader(qwen_run, SMALL, rank=r, world_size=2) for r in range(2)]
    for loader in two:
        next(iter(loader))
    state = two[0].state_dict()
    remaining = pack_ids(two[0], two[0].epoch_packs()[2:])
    for world in (1, 3):
        resumed = [PackedLoader(qwen_run, SMALL, rank=r, world_size=world) for r in range(world)]
        for loader in resumed:
            loader.load_state_dict(state)
        batches = [batch for loader in resumed for batch in ids_of(loader)]
        assert sorted(batches) == sorted(remaining[:len(remaining) // world * world]), world


@pytest.mark.slow
def test_resume_with_another_packing_is_refused(qwen_run):
    state = PackedLoader(qwen_run, SMALL).state_dict()
    with pytest.raises(ValueError, match="packs would differ"):
        PackedLoader(qwen_run, replace(SMALL, max_tokens=900)).load_state_dict(state)


@pytest.mark.slow
def test_mm_token_type_ids_are_what_transformers_computes_the_stored_positions_from(records):
    family = load_family(ModelConfig(family="qwen2_vl"))
    model = Qwen2VLForConditionalGeneration.from_pretrained(family.checkpoint)
    for record in [r for r in records if len(r.grid_thw)][:4]:
        positions, _ = model.model.get_rope_index(record.input_ids[None], mm_token_type_ids(record.token_tags)[None],
                                                  image_grid_thw=record.grid_thw)
        assert torch.equal(positions[:, 0], record.position_ids), record.id


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


@pytest.fixture(scope="module")
def siglip_run(tmp_path_factory) -> Path:
    """A run with an embedding column beside image_embeds: SigLIP2's pooled_embeds, one vector per image."""
    root = tmp_path_factory.mktemp("outputs")
    result = run_embed(f"output.root={root}", "run_name=siglip", "model=siglip2_tiny", "dataset.limit=6")
    assert result.returncode == 0, result.stderr[-3000:]
    return root / "siglip"


@pytest.mark.slow
@pytest.mark.parametrize("run", ["qwen_run", "siglip_run"])
def test_rows_of_load_dataset_become_the_readers_tensors_bit_for_bit_from_the_datasets_features(run, request,
                                                                                              tmp_path):
    run_dir = request.getfixturevalue(run)
    records = list(read_run(run_dir))
    assert any(record.extras for record in records) == (run == "siglip_run")
    dataset = load_run_dataset(run_dir, cache_dir=str(tmp_path / "cache"))
    assert_rows_are_the_runs_records(dataset, records)
    assert_rows_are_the_runs_records(load_run_dataset(run_dir, streaming=True), records)


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.parametrize("run,kind,embedding_columns", [("qwen_run", "data", ["image_embeds"]),
                                                        ("siglip_run", "data", ["image_embeds", "pooled_embeds"]),
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_run_written_before_the_datasets_key_loads_with_its_layouts_from_batchvlms_keys(siglip_run, tmp_path):
    legacy = tmp_path / "legacy-run"
    shutil.copytree(siglip_run, legacy)
    for shard in committed_shards(legacy):
        table = pq.read_table(shard)
        pq.write_table(table.replace_schema_metadata(without_datasets_key(table.schema.metadata)), shard)
    dataset = load_run_dataset(legacy, cache_dir=str(tmp_path / "cache"))
    rows = DatasetRows.from_dataset(dataset)
    expected = {record.id: record for record in read_run(siglip_run)}
    for row in dataset:
        record, read = rows.tensors(row), expected[row["id"]]
        assert torch.equal(record.image_embeds, read.image_embeds)
        assert record.extras.keys() == read.extras.keys()
        assert all(torch.equal(record.extras[k], v) for k, v in read.extras.items())


@pytest.mark.slow
def test_vllm_input_has_the_embedding_rows_vllm_splits_by_grid(records):
    record = next(r for r in records if r.id == "space_trio")
    inputs = vllm_qwen2_vl_image_input(record)
    assert set(inputs) == {"image_embeds", "image_grid_thw"}
    assert inputs["image_grid_thw"].shape == (3, 3)
    assert inputs["image_embeds"].shape == (int((inputs["image_grid_thw"].prod(-1) // 4).sum()), 64)
    with pytest.raises(ValueError, match="merge_size"):
        vllm_qwen2_vl_image_input(record, merge_size=1)


@pytest.mark.slow
def test_only_the_shards_a_manifest_lists_are_read(qwen_run, records):
    stray = qwen_run / "data" / "stray.parquet"
    shutil.copy(committed_shards(qwen_run)[0], stray)  # an orphan of a crashed attempt: same ids again
    try:
        read = [i for batch in ids_of(PackedLoader(qwen_run, SMALL)) for i in batch]
    finally:
        stray.unlink()
    assert sorted(read) == sorted(r.id for r in records)


@pytest.mark.slow
def test_a_shard_converted_whole_gives_the_rows_read_one_by_one(qwen_run):
    table = pq.read_table(committed_shards(qwen_run)[0])
    for index, whole in enumerate(table_tensors(table)):
        alone = tensors_of(table, index)
        assert whole.id == alone.id and whole.rope_delta == alone.rope_delta
        for name in ("input_ids", "image_embeds", "grid_thw", "image_spans", "token_tags", "position_ids"):
            assert torch.equal(getattr(whole, name), getattr(alone, name)), name
        assert whole.position_ids.shape == (3, len(whole.input_ids)) and whole.image_spans.shape[1] == 2


@pytest.mark.slow
@pytest.mark.parametrize("run", ["qwen_run", "siglip_run"])
def test_the_loaders_batches_are_the_packs_of_the_records_read_back(run, request):
    """The loader packs from a shard's columns (reader.ShardColumns), `pack` from records read as tensors: the same."""
    run_dir = request.getfixturevalue(run)
    by_id = {record.id: record for record in read_run(run_dir)}
    batches = list(PackedLoader(run_dir, SMALL))
    assert sum(len(batch.ids) for batch in batches) == len(by_id)
    for batch in batches:
        expected = pack([by_id[i] for i in batch.ids], SMALL.max_tokens)
        for name, value in vars(expected).items():
            if isinstance(value, torch.Tensor):
                got = getattr(batch, name)
                assert got.dtype == value.dtype and torch.equal(got, value), name
        assert expected.extras.keys() == batch.extras.keys()
        assert all(torch.equal(batch.extras[k], v) for k, v in expected.extras.items())


@pytest.mark.slow
def test_a_table_in_several_chunks_gives_the_tensors_of_each_chunk(qwen_run):
    table = pq.read_table(committed_shards(qwen_run)[0])
    halves = table_tensors(pa.concat_tables([table, table.slice(1)]))
    for whole, alone in zip(halves, table_tensors(table) + table_tensors(table.slice(1)), strict=True):
        assert whole.id == alone.id
        for name in ("input_ids", "image_embeds", "image_spans", "token_tags", "position_ids"):
            assert torch.equal(getattr(whole, name), getattr(alone, name)), name


@pytest.mark.slow
def test_a_worker_holds_the_shards_its_remaining_packs_need_and_reads_ahead_a_bounded_few(qwen_run):
    loader = PackedLoader(qwen_run, replace(SMALL, shuffle_buffer=1))
    packs = loader.epoch_packs()
    with ThreadPoolExecutor(1) as reader:
        shards = _OpenShards(loader.index.shards, packs, reader)
        for k, refs in enumerate(packs):
            for shard, row in refs:
                assert shards.record(shard, row).id == pack_ids(loader, [[(shard, row)]])[0][0]
            shards.done_with(k)
            still_needed = {shard for later in packs[k + 1:] for shard, _ in later}
            assert set(shards.open) <= still_needed and len(shards.reading) <= READ_AHEAD
    assert not shards.open and not shards.reading


@pytest.mark.slow
def test_the_loader_bench_reports_the_ratio_to_a_pyarrow_scan_and_packing_efficiency(qwen_run):
    result = bench_loader(BenchConfig(task="loader", run_dir=str(qwen_run), repeats=1, max_tokens=1024))
    assert result["tokens"] == sum(len(ids) for shard in committed_token_counts(qwen_run) for ids in shard)
    assert result["ratio"] > 0 and 0 < result["packing_efficiency"] <= 1
    report = format_loader(result)
    assert "loader / pyarrow scan: " in report and "packing efficiency: " in report


def committed_token_counts(run_dir: Path) -> list[list[int]]:
    return [pq.read_table(path, columns=["input_ids"]).column("input_ids").to_pylist() for path in committed_shards(run_dir)]


def test_the_bench_config_takes_task_loader_and_refuses_an_unknown_task():
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    from batchvlm.config import ConfigError

    ConfigStore.instance().store(name="bench_schema", node=BenchConfig)
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "conf"), version_base=None):
        assert OmegaConf.to_object(compose(config_name="bench", overrides=["task=loader"])).task == "loader"
        with pytest.raises(ConfigError, match="task='train' is not one of preprocess, scale, loader"):
            OmegaConf.to_object(compose(config_name="bench", overrides=["task=train"]))


@pytest.mark.slow
def test_the_readme_training_loop_trains_on_the_run_and_checkpoints_a_resumable_loader(qwen_run, tmp_path,
                                                                                       monkeypatch):
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme[readme.index("### Training on the output"):]
    code = section[section.index("```python") + len("```python"):section.index("```\n", section.index("```python"))]
    monkeypatch.chdir(tmp_path)  # the loop writes checkpoint.pt where it runs
    scope: dict = {}
    exec(code.replace('"outputs/demo-qwen2_vl_tiny"', repr(str(qwen_run))), scope)
    assert scope["loader"].epoch == 2 and torch.isfinite(scope["loss"])
    resumed = PackedLoader(qwen_run, LoaderConfig(max_tokens=1024, seed=0))
    resumed.load_state_dict(torch.load(tmp_path / "checkpoint.pt")["loader"])
    assert (resumed.epoch, resumed.next_pack) == (1, 1)
