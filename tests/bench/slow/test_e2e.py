"""The e2e bench puts the job beside its tower (synchronized, in bf16, on real image sizes, over several units and
workers), counts the job's syncs per batch, puts the sink beside a bare write, and each stage alone."""

from __future__ import annotations

import pytest

from batchvlm.bench.tasks import BenchConfig


@pytest.mark.slow
def test_e2e_bench_puts_the_job_beside_its_tower_and_the_sink_beside_a_bare_write():
    from batchvlm.bench.e2e import bench_e2e, format_e2e

    result = bench_e2e(BenchConfig(task="e2e", tower="tiny", records=4, device="cpu"))
    assert (result["dtype"], result["workers"], result["units"]) == ("bfloat16", 2, 4)
    assert set(result["stages"]) == {"decode", "plan+layout", "preprocess", "tower+checks", "assemble", "sink",
                                     "text (render+tokenize+expand+mask)"}
    assert set(result["text_side"]) == {4, 32} and all(rate > 0 for rate in result["text_side"].values())
    assert all(rate > 0 for rate in result["stages"].values())
    assert result["job_images_per_s"] > 0 and result["tower_images_per_s"] > 0
    assert result["batch_by_batch_images_per_s"] > 0 and result["device_decode_images_per_s"] > 0
    for syncs in (result["syncs"], result["batch_by_batch_syncs"]):  # one wait per batch, nothing implicit (CPU)
        assert syncs["batches"] >= 1 and syncs["waits"] == syncs["batches"] and syncs["implicit"] == 0
    assert all(result["decode"][key] > 0
               for key in ("safe_images_per_s", "batched_images_per_s", "header_images_per_s"))
    assert result["decode"]["max_levels"] == 0  # libjpeg-turbo both ways on the CPU
    assert result["device_decode_embeddings"] == {"max_abs": 0.0, "relative": 0.0}  # the same pixels, the same rows
    host = result["host"]
    assert host["workers"] == 2 and host["ratio"] == host["job_images_per_s"] / (2 * host["decode_images_per_s"])
    report = format_e2e(result)
    assert "batch by batch" in report and "batched torchvision on cpu" in report and "syncs per batch" in report
    assert "end-to-end" in report and "bare pq.write_table" in report and "in bfloat16" in report
    assert "conversations/s at 4 turns vs decode" in report
    assert "host ceiling (zero-cost tower and preprocessing)" in report and "its embeddings off the safe" in report


@pytest.mark.slow
def test_without_stages_the_e2e_bench_runs_the_jobs_the_tower_and_the_host_ceiling_only():
    from batchvlm.bench.e2e import bench_e2e, format_e2e

    result = bench_e2e(BenchConfig(task="e2e", tower="tiny", records=2, device="cpu", job_workers=1, stages=False))
    assert "stages" not in result and result["host"]["ratio"] > 0 and result["tower_images_per_s"] > 0
    assert "stages alone" not in format_e2e(result) and "host ceiling" in format_e2e(result)
