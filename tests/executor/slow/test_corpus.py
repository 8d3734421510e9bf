"""Pillow's own odd and hostile test images, run through the job: every file accounted for, none crash it."""

from __future__ import annotations

from pathlib import Path

import datasets
import pyarrow.parquet as pq
import pytest

from conftest import run_embed_measured, shared_folder

PEAK_RSS_LIMIT_GIB = 4.0

# the job on 408 files: about a minute on 2 cores
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def corpus_parquet(tmp_path_factory) -> tuple[Path, list[str]]:
    corpus = shared_folder("corpus/pillow")
    files = sorted(p for p in corpus.rglob("*") if p.is_file())
    ids = [str(p.relative_to(corpus)) for p in files]
    features = datasets.Features({"id": datasets.Value("string"), "images": datasets.List(datasets.Image()),
                                  "text": datasets.Value("string")})
    table = {"id": ids, "images": [[{"bytes": p.read_bytes(), "path": None}] for p in files],
             "text": [f"<image> Pillow test file {name}" for name in ids]}
    path = tmp_path_factory.mktemp("corpus") / "corpus.parquet"
    datasets.Dataset.from_dict(table, features=features).to_parquet(str(path))
    return path, ids


def test_every_corpus_file_is_embedded_or_quarantined_with_a_reason(corpus_parquet, tmp_path):
    path, ids = corpus_parquet
    result, peak_gib = run_embed_measured("dataset=parquet", f"dataset.path={path}", f"output.root={tmp_path}",
                                          "run_name=corpus", "dataset.unit_records=50",
                                          "checks.max_quarantine_fraction=1.0")
    assert result.returncode == 0, result.stderr[-4000:]
    run = tmp_path / "corpus"
    written = [r["id"] for p in (run / "data").glob("*.parquet") for r in pq.read_table(p, columns=["id"]).to_pylist()]
    quarantined = [r for p in (run / "quarantine").glob("*.parquet") for r in pq.read_table(p).to_pylist()]
    assert sorted(written + [r["id"] for r in quarantined]) == sorted(ids)  # nothing missing, nothing twice
    assert len(written) > 100  # the ordinary images of the corpus do get embedded
    for row in quarantined:
        assert row["check"].startswith("decode.") and row["message"], row["id"]
    checks = {row["check"] for row in quarantined}
    assert {"decode.format_not_allowed", "decode.truncated", "decode.too_many_pixels"} <= checks
    by_id = {row["id"]: row["check"] for row in quarantined}
    assert by_id["bmp/b/reallybig.bmp"] == "decode.too_many_pixels"  # refused from its header
    assert by_id["decompression_bomb.ico"] == "decode.format_not_allowed"  # never reaches the ICO decoder
    assert by_id["eps/zero_bb.eps"] == "decode.format_not_allowed"  # never reaches Ghostscript
    assert peak_gib < PEAK_RSS_LIMIT_GIB  # bombs are refused before their pixels are allocated
