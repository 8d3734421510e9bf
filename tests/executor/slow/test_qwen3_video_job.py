"""Qwen3-VL clips through the embed job, end to end (issue 31): the Qwen3-VL checkpoint variant over Qwen2's real
vocabulary and Qwen3-VL's published template, LLaVA records with a clip and an image and with two clips, run in this
process (its DataLoader worker and isolated decoder), bf16 as users run it. Each stored value is held to an oracle no
one here wrote: the ids to `Qwen3VLProcessor` (`apply_chat_template`, then its expansion: a `<t seconds>` timestamp and
a span per temporal patch), `video_grid_thw` to its video processor, the clip tokens and their deepstack features to the
model's own `get_video_features`, the positions to its `get_rope_index`, the loss of a stored row to the model's own on
the processor's pixels; a truncated clip and a clip without its placeholder quarantined under their checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import embed_in_process
from test_video_job import RECORDS, reference_inputs, rows_of, write_dataset

from batchvlm.format.schema import FRAME, TEXT, VIDEO
from batchvlm.training.interop import mm_token_type_ids

pytestmark = pytest.mark.slow

TOLERANCE = 3e-2
"""Largest difference of the bf16 run's stored tokens from the fp32 model's own, relative to its largest value."""


@pytest.fixture(scope="module")
def qwen3_run(tmp_path_factory, qwen_real_checkpoint):
    from transformers import Qwen3VLVideoProcessor

    from qwen_vocab import write_qwen3_checkpoint

    video = Qwen3VLVideoProcessor(size={"shortest_edge": 32 * 32 * 16, "longest_edge": 32 * 32 * 64},
                                  max_video_tokens=64, cap_pixels_per_frame=True)
    checkpoint = write_qwen3_checkpoint(tmp_path_factory.mktemp("qwen3_vl"), qwen_real_checkpoint, video)
    dataset = write_dataset(tmp_path_factory.mktemp("clips"))
    run = embed_in_process(tmp_path_factory.mktemp("outputs"), "clips", "dataset=llava", f"dataset.path={dataset}",
                           "model=qwen2_vl_tiny", f"model.path={checkpoint}", "model.dtype=bfloat16",
                           "output.embed_dtype=bfloat16", "preprocess.backend=torch",
                           "checks.max_quarantine_fraction=0.9")
    return checkpoint, dataset.parent, run


def model_of(checkpoint):
    from transformers import Qwen3VLForConditionalGeneration

    return Qwen3VLForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()


def stored(row: dict, column: str, hidden: int) -> torch.Tensor:
    return torch.frombuffer(bytearray(row[column]), dtype=torch.bfloat16).view(-1, hidden).float()


def close(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    return ours.shape == theirs.shape and bool((ours - theirs).abs().max() <= TOLERANCE * theirs.abs().max())


def test_qwen3_clips_are_stored_as_the_checkpoints_processor_and_model_give_them(qwen3_run):
    checkpoint, folder, run = qwen3_run
    rows = rows_of(run, "data")
    assert set(rows) == {"clip_and_image", "two_clips"}
    model = model_of(checkpoint)
    for record in RECORDS[:2]:
        row, reference = rows[record["id"]], reference_inputs("qwen3_vl", checkpoint, folder, record)
        assert row["input_ids"] == reference["input_ids"][0].tolist(), record["id"]
        grids = reference["video_grid_thw"]
        assert row["video_grid_thw"] == grids.tolist() and all(t > 1 for t, _, _ in grids.tolist())
        with torch.inference_mode():
            theirs = model.model.get_video_features(reference["pixel_values_videos"], grids)
            types = mm_token_type_ids(torch.tensor([row["token_tags"]], dtype=torch.int8))
            positions, delta = model.model.get_rope_index(reference["input_ids"], types,
                                                          image_grid_thw=reference.get("image_grid_thw"),
                                                          video_grid_thw=grids)
        assert types.tolist() == reference["mm_token_type_ids"].tolist()
        tokens = torch.cat(theirs.pooler_output)
        assert close(stored(row, "video_embeds", tokens.shape[-1]), tokens), record["id"]
        assert sum(row["video_num_tokens"]) == len(tokens)
        # the deepstack layers of every clip token, side by side along hidden in layer order, as for images
        layers = torch.cat([torch.cat(layer) for layer in theirs.deepstack_features], dim=-1)
        assert close(stored(row, "video_deepstack_embeds", layers.shape[-1]), layers), record["id"]
        assert row["position_ids"] == positions[:, 0].tolist() and row["rope_delta"] == int(delta), record["id"]
        # one span per temporal patch, each after its timestamp (text, never trained)
        tags, mask = np.asarray(row["token_tags"]), np.asarray(row["loss_mask"])
        assert len(row["video_spans"]) == int(grids[:, 0].sum())
        for span in row["video_spans"]:
            start, length = span["start"], span["length"]
            assert tags[start - 1:start + length + 1].tolist() == [FRAME] + [VIDEO] * length + [FRAME]
            assert tags[start - 2] == TEXT and not mask[start - 6:start + length + 1].any()


def test_a_truncated_qwen3_clip_and_a_clip_without_its_placeholder_are_quarantined(qwen3_run):
    _, _, run = qwen3_run
    quarantined = rows_of(run, "quarantine")
    assert {key: row["check"] for key, row in quarantined.items()} == {
        "truncated": "video.truncated", "unplaced": "text.placeholder_count"}
    assert quarantined["truncated"]["video_index"] == 0


def test_a_stored_qwen3_clip_row_trains_with_the_loss_the_model_gives_on_its_pixels(qwen3_run):
    """training.model_inputs on the stored rows (clip tokens and their deepstack layers as
    `mm_encoder_outputs["video"]`, the images' as `["image"]`, the stored positions), against the model's own forward
    on the processor's `pixel_values_videos` / `pixel_values` (its own positions and deepstack), same labels."""
    from batchvlm.training.model_inputs import model_inputs
    from batchvlm.training.packing import pack
    from batchvlm.training.reader import read_run

    checkpoint, folder, run = qwen3_run
    model = model_of(checkpoint)
    records = {record.id: record for record in read_run(run)}
    for record in RECORDS[:2]:
        batch = pack([records[record["id"]]], 4096)
        assert len(batch.video_deepstack_embeds) == 2 and len(batch.video_deepstack_embeds[0]) == len(
            batch.video_embeds) == (batch.token_tags == VIDEO).sum()
        reference = reference_inputs("qwen3_vl", checkpoint, folder, record)
        with torch.inference_mode():
            ours = model(**model_inputs(model, batch)).loss
            theirs = model(**{key: value for key, value in reference.items() if key != "attention_mask"},
                           labels=batch.labels, use_cache=False).loss
        assert torch.isfinite(ours) and abs(float(ours) - float(theirs)) <= 1e-2 * abs(float(theirs)), record["id"]


def test_the_estimate_sizes_qwen3_clip_records_from_their_headers_alone(qwen3_run):
    """batchvlm-estimate on the same records: each clip probed and sampled by Qwen3-VL's rule, none decoded; its rows
    are as wide as the job's (clip tokens and their deepstack layers counted), the bad records quarantined."""
    from batchvlm.families import ModelConfig
    from batchvlm.rundir.sink import OutputConfig
    from batchvlm.sizing.estimate import EstimateConfig, estimate
    from batchvlm.sources.config import dataset_config

    checkpoint, folder, run = qwen3_run
    result = estimate(EstimateConfig(
        dataset=dataset_config(kind="json", format="llava", images_column="image", text_column="conversations",
                               path=str(folder / "llava.json")),
        model=ModelConfig(family="qwen2_vl", path=str(checkpoint)), output=OutputConfig(embed_dtype="bfloat16"),
        records=len(RECORDS)))
    assert result.sampled == len(RECORDS) and result.quarantined == 2
    written = rows_of(run, "data").values()
    assert result.data_bytes_per_record > min(len(row["video_embeds"]) + len(row["video_deepstack_embeds"])
                                              for row in written)


def test_the_packed_loader_gives_each_qwen3_clip_token_its_row_and_deepstack_layers(qwen3_run):
    """PackedLoader over the run: both clip records in one pack, each clip token's stored row and deepstack layers at
    its place (the layers split from the stored column, one tensor per layer, as for images)."""
    from batchvlm.training.loader import LoaderConfig, PackedLoader

    _, _, run = qwen3_run
    rows = rows_of(run, "data")
    (batch,) = list(PackedLoader(run, LoaderConfig(max_tokens=4096, shuffle_buffer=1, num_workers=0)))
    hidden = batch.image_embeds.shape[-1]
    tokens = torch.cat([stored(rows[key], "video_embeds", hidden) for key in batch.ids])
    layers = torch.cat([stored(rows[key], "video_deepstack_embeds", 2 * hidden) for key in batch.ids])
    assert torch.equal(batch.video_embeds.float(), tokens)
    assert torch.equal(torch.cat(batch.video_deepstack_embeds, dim=-1).float(), layers)
    assert torch.equal(batch.video_positions, torch.nonzero(batch.token_tags[0] == VIDEO).flatten())


def test_the_row_collator_over_load_run_dataset_gives_the_model_qwen3_clips_with_their_deepstack(qwen3_run, tmp_path):
    """The stock path (`load_run_dataset` rows, `RowCollator`): the clips reach the model as
    `mm_encoder_outputs["video"]` with their deepstack layers, and the loss is the packed loader's."""
    from batchvlm.training import load_run_dataset
    from batchvlm.training.model_inputs import model_inputs
    from batchvlm.training.packing import pack
    from batchvlm.training.reader import read_run
    from batchvlm.training.trainer import RowCollator

    checkpoint, _, run = qwen3_run
    model = model_of(checkpoint)
    dataset = load_run_dataset(run, cache_dir=str(tmp_path / "cache"))
    rows = [dataset[i] for i in range(len(dataset))]
    batch = RowCollator(model, dataset, max_tokens=4096)(rows)
    video = batch["mm_encoder_outputs"]["video"]
    by_id = {record.id: record for record in read_run(run)}
    packed = pack([by_id[row["id"]] for row in rows], 4096)
    assert torch.equal(torch.cat(video.pooler_output), packed.video_embeds)
    assert all(torch.equal(torch.cat(theirs), ours)
               for theirs, ours in zip(video.deepstack_features, packed.video_deepstack_embeds, strict=True))
    with torch.inference_mode():
        assert float(model(**batch).loss) == pytest.approx(float(model(**model_inputs(model, packed)).loss),
                                                           rel=1e-5)


def test_trls_packed_sft_trainer_takes_qwen3_clips_with_the_models_own_loss_and_trains(qwen3_run, tmp_path):
    """PackedSFTTrainer (TRL's SFTTrainer over the packed loader) on the run: its loss on the pack with both clip
    records is the model's own on model_inputs (clips and their deepstack layers included), and one step trains."""
    trl = pytest.importorskip("trl")
    from transformers import AutoTokenizer

    from batchvlm.training.loader import LoaderConfig, PackedLoader
    from batchvlm.training.model_inputs import model_inputs
    from batchvlm.training.sft import PackedSFTTrainer

    checkpoint, _, run = qwen3_run
    config = LoaderConfig(max_tokens=4096, shuffle_buffer=1, num_workers=0)
    first = next(iter(PackedLoader(run, config)))
    assert first.video_deepstack_embeds is not None
    args = trl.SFTConfig(output_dir=str(tmp_path / "sft"), use_cpu=True, bf16=False, remove_unused_columns=False,
                         activation_checkpointing=False, report_to=[], save_strategy="no", logging_steps=1,
                         learning_rate=1e-4, max_steps=1)
    trainer = PackedSFTTrainer(model_of(checkpoint), args, PackedLoader(run, config),
                               processing_class=AutoTokenizer.from_pretrained(checkpoint))
    trainer.model.eval()
    with torch.no_grad():
        expected = float(trainer.model(**model_inputs(trainer.model, first)).loss)
        inputs = trainer.batch_inputs(first)
        assert inputs["mm_encoder_outputs"]["video"].deepstack_features is not None
        assert float(trainer.compute_loss(trainer.model, inputs)) == pytest.approx(expected, rel=1e-5, abs=1e-6)
    trainer.model.train()
    trainer.train()
    logged = next(entry["loss"] for entry in trainer.state.log_history if "loss" in entry)
    assert np.isfinite(logged)
