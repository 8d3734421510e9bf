"""One dataset in img2dataset's three shapes (Parquet, WebDataset tars, Parquet on an S3 server) gives one output;
failed downloads are quarantined in each, never written as text-only rows."""

from __future__ import annotations

import io
import json
import socket
import tarfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image
from skimage import data

from batchvlm.training.reader import read_run
from conftest import summary_in_process

# the job on each input kind, S3 served by moto
pytestmark = pytest.mark.slow

PHOTOS = {"000000": data.chelsea()[::4, ::4], "000001": data.coffee()[::4, ::4], "000002": data.astronaut()[::4, ::4],
          "000003": data.rocket()[::4, ::4]}
FAILED = "000004"  # img2dataset keeps a failed download as a row without image bytes


def _jpeg(pixels) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG")
    return buffer.getvalue()


def _samples() -> list[dict]:
    ok = [{"key": key, "jpg": _jpeg(pixels), "caption": f"photo {key}", "status": "success", "error_message": None}
          for key, pixels in PHOTOS.items()]
    return ok + [{"key": FAILED, "jpg": None, "caption": "never fetched", "status": "failed_to_download",
                  "error_message": "HTTP 404"}]


def _write_parquet(path, samples) -> None:
    pq.write_table(pa.Table.from_pylist(samples), path, row_group_size=2)


def _write_tar(path, samples) -> None:
    with tarfile.open(path, "w") as tar:
        for sample in samples:
            parts = {"txt": sample["caption"].encode(), "json": json.dumps(
                {k: sample[k] for k in ("key", "status", "error_message", "caption")}).encode()}
            if sample["jpg"] is not None:
                parts["jpg"] = sample["jpg"]
            for part, payload in parts.items():
                info = tarfile.TarInfo(f"{sample['key']}.{part}")
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))


@pytest.fixture(scope="module")
def s3_server():
    """A real S3-protocol server (moto) on a free local port."""
    from moto.server import ThreadedMotoServer

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


def _outputs(run_dir) -> dict[str, tuple]:
    return {r.id: (r.input_ids.tolist(), r.grid_thw.tolist(), r.image_embeds.float().sum().item())
            for r in read_run(run_dir)}


def _quarantined(run_dir) -> dict[str, str]:
    return {row["id"]: row["check"] for path in (run_dir / "quarantine").glob("*.parquet")
            for row in pq.read_table(path, columns=["id", "check"]).to_pylist()}


def test_webdataset_and_s3_inputs_give_the_rows_of_the_parquet_copy(tmp_path, s3_server, monkeypatch):
    import s3fs

    samples = _samples()
    _write_parquet(tmp_path / "part-00000.parquet", samples)
    _write_tar(tmp_path / "00000.tar", samples)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    s3 = s3fs.S3FileSystem(endpoint_url=s3_server)
    s3.mkdir("laion")
    s3.put(str(tmp_path / "part-00000.parquet"), "laion/shards/part-00000.parquet")

    common = ["runtime.num_workers=0", "dataset.unit_records=2"]
    runs = {
        "parquet": ["dataset=img2dataset_parquet", f"dataset.path={tmp_path}/part-00000.parquet"],
        "webdataset": ["dataset=img2dataset_webdataset", f"dataset.path={tmp_path}/*.tar"],
        "s3": ["dataset=img2dataset_parquet", "dataset.path=s3://laion/shards/*.parquet",
               f"+dataset.storage_options.endpoint_url={s3_server}"],
    }
    outputs = {}
    for name, overrides in runs.items():
        summary = summary_in_process(tmp_path / "out", name, *overrides, *common)  # what it writes: in this process
        assert summary is not None and summary["complete"]
        outputs[name] = _outputs(tmp_path / "out" / name)
        assert _quarantined(tmp_path / "out" / name) == {FAILED: "source.download_failed"}, name
    assert sorted(outputs["parquet"]) == sorted(PHOTOS)
    assert outputs["webdataset"] == outputs["parquet"]
    assert outputs["s3"] == outputs["parquet"]
    units = json.loads((tmp_path / "out" / "s3" / "units.json").read_text())["units"]
    assert [(u["start"], u["stop"]) for u in units] == [(0, 2), (2, 4), (4, 5)]  # from the footer's row groups


# -- malformed shards: quarantined with their evidence, the rest of the shard read ------------------------------------
def _add(tar: tarfile.TarFile, name: str, payload: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(payload)
    tar.addfile(info, io.BytesIO(payload))


def _malformed_shard(path) -> None:
    photo = _jpeg(PHOTOS["000000"])
    with tarfile.open(path, "w") as tar:
        _add(tar, "good.jpg", photo)
        _add(tar, "good.txt", b"<image> a cat")
        _add(tar, "notjson.jpg", photo)
        _add(tar, "notjson.json", b"{not json")
        _add(tar, "alist.jpg", photo)
        _add(tar, "alist.json", b"[1, 2]")
        _add(tar, "strange.xyz", b"who knows")
        _add(tar, "huge.jpg", photo * 40)
        _add(tar, "last.jpg", photo)
        _add(tar, "last.txt", b"<image> the last whole sample")
    whole = path.read_bytes()
    path.write_bytes(whole[:whole.index(b"last.txt") - 1000])  # cut inside the last sample's image


def test_a_malformed_shard_quarantines_each_bad_sample_and_its_lost_tail_and_reads_the_rest(tmp_path):
    from batchvlm.sources.config import dataset_config
    from batchvlm.sources import make_source

    _malformed_shard(tmp_path / "bad.tar")
    cfg = dataset_config("webdataset", path=str(tmp_path / "bad.tar"), id_column="__key__", images_column="jpg",
                        text_column="txt")
    source = make_source(cfg, max_bytes=len(_jpeg(PHOTOS["000000"])) * 10)
    (unit,) = source.plan()
    records = list(source.records(unit))
    assert [(r.id, r.failure.check if r.failure else None) for r in records] == [
        ("good", None), ("notjson", "source.bad_metadata"), ("alist", "source.bad_metadata"),
        ("strange", "source.unrecognised_sample"), ("huge", None), (f"{unit.source}#5", "source.truncated")]
    huge = records[4].images[0]
    assert huge.data is None and huge.size > source.max_bytes  # never read into memory
    assert "is not readable after 5 samples" in records[-1].failure.message


def test_the_job_over_a_malformed_shard_commits_it_with_the_bad_samples_quarantined(tmp_path):
    _malformed_shard(tmp_path / "bad.tar")
    summary = summary_in_process(tmp_path, "bad", "dataset=webdataset", f"dataset.path={tmp_path / 'bad.tar'}",
                                 "dataset.images_column=jpg", "dataset.text_column=txt",
                                 f"decode.max_bytes={len(_jpeg(PHOTOS['000000'])) * 10}",
                                 "checks.max_quarantine_fraction=1")
    assert summary is not None and summary["complete"]
    quarantined = {row["id"]: row["check"] for row in pq.read_table(next((tmp_path / "bad" / "quarantine").glob(
        "*.parquet"))).to_pylist()}
    assert sorted(quarantined.values()) == ["decode.too_many_bytes", "source.bad_metadata", "source.bad_metadata",
                                            "source.truncated", "source.unrecognised_sample"]
    assert [record.id for record in read_run(tmp_path / "bad")] == ["good"]
