"""The device stage: failures pinned on the record that caused them, batch k+1 staged while batch k encodes, and on
the demo, overlap and the batched JPEG decode change nothing that is written."""

from __future__ import annotations

import pytest
import torch

from batchvlm.checks import CheckFailed
from batchvlm.executor import device as stage
from batchvlm.devices import Syncs
from batchvlm.executor.device import Device
from batchvlm.executor.overlap import Streams
from batchvlm.executor.tally import SystematicFailure
from batchvlm.records import EncodedRecord, ImagePlan, PixelBatch, PreparedRecord, SourceRecord


def record(record_id: str, *patches: int) -> PreparedRecord:
    """A record with one image of `n` patches per argument (a 1 x n grid)."""
    plans = [ImagePlan((n, 1), (n, 1), (n, 1), (1, n, 1), n) for n in patches]
    source = SourceRecord(id=record_id, unit_id="u", source="s.parquet", row=0, text="", images=[])
    return PreparedRecord(source=source, images=[], plans=plans, layout=None)


def ids(records) -> list[str]:
    return [r.source.id if isinstance(r, PreparedRecord) else r.prepared.source.id for r in records]


# -- Device.encode ----------------------------------------------------------------------------
class Tower:
    """Encodes a batch unless it holds a record of `raises`; counts the batches it was given."""

    def __init__(self, raises: dict[str, Exception]):
        self.raises, self.batches = raises, []

    def __call__(self, records: list[PreparedRecord]) -> list[EncodedRecord]:
        self.batches.append(ids(records))
        for r in records:
            if r.source.id in self.raises:
                raise self.raises[r.source.id]
        return [EncodedRecord(r, []) for r in records]


def packed(records, preprocessor, guard, syncs=None) -> PixelBatch:
    """Preprocessing that passes the records through, unless one of them is in `preprocessor` (raised there)."""
    for r in records:
        if preprocessor and r.source.id in preprocessor:
            raise preprocessor[r.source.id]
    return PixelBatch(pixel_values=torch.zeros(0), grid_thw=torch.zeros(0, 3), records=records)


@pytest.fixture
def device(monkeypatch):
    """A Device whose tower is a Tower, and whose preprocessing raises for the records of `pack_raises`;
    with `overlap`, batch k is finished once k+1 is launched and k+2 staged (the CPU's streams: none)."""
    monkeypatch.setattr(stage, "preprocess_batch", packed)
    monkeypatch.setattr(stage, "encode_batch", lambda tower, batch, out_dtype=None, syncs=None: tower(batch.records))
    monkeypatch.setattr(stage, "launch_batch", lambda tower, batch, out_dtype=None, stream=None: tower(batch.records))
    monkeypatch.setattr(stage, "finish_batch", lambda launched, syncs: launched)
    return lambda raises, pack_raises=None, overlap=False: Device(preprocessor=pack_raises, encoder=Tower(raises),
                                                                  overlap=overlap)


def test_an_error_in_a_batch_is_bisected_to_its_record_and_the_rest_is_encoded_in_order(device):
    on_device = device({"r5": RuntimeError("CUDA out of memory")})
    batch = [record(f"r{i}", 4) for i in range(8)]
    encoded, quarantined = on_device.checked(batch)
    assert ids(encoded) == ["r0", "r1", "r2", "r3", "r4", "r6", "r7"]
    assert [(q.source.id, q.failure.check, q.failure.message) for q in quarantined] == [
        ("r5", "encode.failed", "RuntimeError: CUDA out of memory")]
    assert len(on_device.encoder.batches) == 7  # 8, then 4 + 4, 2 + 2, 1 + 1: log2(n) rounds, not n


def test_two_bad_records_of_one_batch_are_both_pinned(device):
    on_device = device({"r0": ValueError("bad"), "r3": ValueError("worse")})
    encoded, quarantined = on_device.checked([record(f"r{i}", 4) for i in range(4)])
    assert ids(encoded) == ["r1", "r2"]
    assert [q.source.id for q in quarantined] == ["r0", "r3"]


def test_a_check_that_names_its_record_quarantines_it_without_bisecting(device):
    batch = [record(f"r{i}", 4) for i in range(6)]
    failure = CheckFailed("preprocess.grid_match", "grid differs", "(1, 4, 1)", "(1, 2, 2)", image_index=0)
    failure.record = batch[2]
    on_device = device({"r2": failure})
    encoded, quarantined = on_device.checked(batch)
    assert ids(encoded) == ["r0", "r1", "r3", "r4", "r5"]
    assert [(q.source.id, q.failure.check) for q in quarantined] == [("r2", "preprocess.grid_match")]
    assert on_device.encoder.batches == [ids(batch), ["r0", "r1", "r3", "r4", "r5"]]


def test_a_check_without_its_record_is_bisected_and_keeps_its_name(device):
    on_device = device({"r1": CheckFailed("encode.finite", "NaN in the embeddings", "finite", "nan")})
    encoded, quarantined = on_device.checked([record(f"r{i}", 4) for i in range(3)])
    assert ids(encoded) == ["r0", "r2"]
    assert [(q.source.id, q.failure.check, q.failure.observed) for q in quarantined] == [("r1", "encode.finite", "nan")]


def test_an_empty_batch_never_reaches_the_tower(device):
    on_device = device({})
    assert on_device.checked([]) == ([], [])
    assert on_device.submit([]) == [] and on_device.drain() == []
    assert on_device.encoder.batches == []


# -- Device.submit: batch k finished once k+1 is launched and k+2 staged -----------------------
def outcome_ids(outcomes) -> tuple[list[str], list[tuple[str, str]]]:
    encoded = [o for o in outcomes if isinstance(o, EncodedRecord)]
    return ids(encoded), [(q.source.id, q.failure.check) for q in outcomes if not isinstance(q, EncodedRecord)]


def submit_all(on_device, batches) -> list[tuple[list[str], list[tuple[str, str]]]]:
    """What the job does: each batch handed in, then the rest drained at the end; the results as they come back."""
    results = [outcome_ids(on_device.submit(batch)) for batch in batches] + [outcome_ids(on_device.drain())]
    assert on_device.staged is None and on_device.running is None
    return results


def test_with_overlap_each_batch_comes_back_two_batches_later_and_the_last_ones_at_the_end(device):
    batches = [[record("a", 4), record("b", 4)], [record("c", 4)], [record("d", 4)]]
    results = submit_all(device({}, overlap=True), batches)
    assert results == [([], []), ([], []), (["a", "b"], []), (["c", "d"], [])]  # nothing lost at the end


def test_without_overlap_each_batch_comes_back_at_once(device):
    batches = [[record("a", 4), record("b", 4)], [record("c", 4)]]
    assert submit_all(device({}), batches) == [(["a", "b"], []), (["c"], []), ([], [])]


def test_failures_in_the_staged_batch_are_pinned_while_the_batch_before_it_encodes(device):
    """Batch k+1 holds a record its preprocessing raises on and one the tower raises on, staged while batch k
    (clean) is in flight: batch k comes back whole, and batch k+1's failures are pinned on their records."""
    bad_pixels = CheckFailed("preprocess.grid_match", "grid differs", "(1, 4, 1)", "(1, 2, 2)", image_index=0)
    batches = [[record(f"k{i}", 4) for i in range(4)], [record(f"n{i}", 4) for i in range(4)]]
    bad_pixels.record = batches[1][1]
    on_device = device({"n3": RuntimeError("CUDA out of memory")}, pack_raises={"n1": bad_pixels}, overlap=True)
    results = submit_all(on_device, batches)
    assert results == [([], []), ([], []), (["k0", "k1", "k2", "k3", "n0", "n2"],
                                            [("n1", "preprocess.grid_match"), ("n3", "encode.failed")])]


def test_overlap_on_and_off_give_the_same_records_in_the_same_order(device):
    def batches():
        return [[record(f"b{b}r{r}", 4) for r in range(3)] for b in range(4)]

    raises = {"b1r2": ValueError("bad"), "b3r0": RuntimeError("CUDA out of memory")}
    pack_raises = {"b2r1": RuntimeError("a backend crash")}

    def flat(results):  # the encoded records in order, the quarantined ones in order
        return [i for encoded, _ in results for i in encoded], [q for _, quarantined in results for q in quarantined]

    with_overlap = flat(submit_all(device(raises, pack_raises, overlap=True), batches()))
    without = flat(submit_all(device(raises, pack_raises), batches()))
    assert with_overlap == without
    assert ("b1r2", "encode.failed") in with_overlap[1] and ("b2r1", "encode.failed") in with_overlap[1]


# -- failures that are the job's own stop it ---------------------------------------------------
DTYPE_MISMATCH = "Input type (float) and bias type (c10::BFloat16) should be the same"


@pytest.mark.parametrize("overlap", [False, True])
def test_a_cuda_error_stops_the_job_and_is_pinned_on_no_record(device, overlap):
    on_device = device({"r2": RuntimeError("CUDA error: an illegal memory access was encountered")}, overlap=overlap)
    with pytest.raises(SystematicFailure, match="a CUDA error, not a fault of any record: .*illegal memory access"):
        for batch in ([record("r0", 4), record("r1", 4)], [record("r2", 4), record("r3", 4)]):
            on_device.submit(batch)
        on_device.drain()


@pytest.mark.parametrize("overlap", [False, True])
def test_the_same_error_on_every_record_of_two_batches_in_a_row_stops_the_job_with_none_quarantined(device, overlap):
    batches = [[record(f"b{b}r{r}", 4) for r in range(3)] for b in range(3)]
    on_device = device({r.source.id: RuntimeError(DTYPE_MISMATCH) for batch in batches for r in batch},
                       overlap=overlap)
    emitted = []
    with pytest.raises(SystematicFailure, match=f"every record of two batches in a row failed with "
                                                f"RuntimeError: {DTYPE_MISMATCH.replace('(', '.').replace(')', '.')}"):
        for batch in batches:
            emitted += on_device.submit(batch)
        emitted += on_device.drain()
    assert emitted == []  # the first batch's records were held back, never quarantined


def test_a_batch_failing_alike_throughout_is_quarantined_when_the_next_batch_fails_otherwise(device):
    first = [record(f"a{r}", 4) for r in range(3)]
    on_device = device({**{r.source.id: RuntimeError(DTYPE_MISMATCH) for r in first}, "b1": ValueError("bad")})
    assert on_device.submit(first) == []  # held until the next batch decides
    assert outcome_ids(on_device.submit([record("b0", 4), record("b1", 4)])) == (
        ["b0"], [("a0", "encode.failed"), ("a1", "encode.failed"), ("a2", "encode.failed"), ("b1", "encode.failed")])


def test_a_batch_failing_alike_throughout_at_the_end_of_the_stream_is_quarantined(device):
    on_device = device({"a0": RuntimeError(DTYPE_MISMATCH), "a1": RuntimeError(DTYPE_MISMATCH)})
    assert on_device.submit([record("a0", 4), record("a1", 4)]) == []
    assert outcome_ids(on_device.drain()) == ([], [("a0", "encode.failed"), ("a1", "encode.failed")])


# -- the hot loop: one sync per batch, the next tower queued before it ---------------------------
class Logged(Syncs):
    """The seam, writing each wait into the log it shares with the tower."""

    def __init__(self, log: list[str]):
        super().__init__()
        self.log = log

    def wait(self, event) -> None:
        self.log.append("wait")
        super().wait(event)


@pytest.mark.parametrize("where", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (bash jobs/gpu_check.sh)"))])
def test_the_hot_loop_syncs_once_per_batch_and_queues_the_next_tower_before_it_waits(kimi_family, where):
    """Counted through the seam: on the CPU the waits the loop makes on purpose; on CUDA also every implicit sync,
    which torch.cuda.set_sync_debug_mode reports (there must be none)."""
    from photos import photo_of_size

    from batchvlm.pipeline.preprocess import make_preprocessor
    from batchvlm.records import DecodedImage, TokenLayout

    on = torch.device(where)
    log = []
    tower = kimi_family.load_encoder(on, torch.bfloat16)

    class Tower:
        hidden_sizes = tower.hidden_sizes

        def __call__(self, pixel_values, grid_thw):
            log.append("tower")
            return tower(pixel_values, grid_thw)

    def prepared(name: str, height: int, width: int) -> PreparedRecord:
        image = DecodedImage(photo_of_size(height, width), "PNG", name.ljust(64, "0"))
        return PreparedRecord(SourceRecord(name, "u", "s", 0, "", []), [image], [kimi_family.plan(height, width)],
                              TokenLayout([], [], []))

    on_device = Device(make_preprocessor("triton" if where == "cuda" else "torch", kimi_family, on, "black"), Tower(),
                       out_dtype=torch.bfloat16, overlap=True, streams=Streams(on), syncs=Logged(log))
    batches = [[prepared(f"b{b}r{r}", 28 * (b + 1), 56) for r in range(2)] for b in range(3)]
    with on_device.syncs.counting(on):
        outcomes = [on_device.submit(batch) for batch in batches] + [on_device.drain()]
    assert [len(o) for o in outcomes] == [0, 0, 2, 4] and all(isinstance(o, EncodedRecord) for o in outcomes[3])
    assert log == ["tower", "tower", "wait", "tower", "wait", "wait"]  # batch k+1's tower queued before k's wait
    syncs = on_device.syncs
    assert (syncs.batches, syncs.waits, syncs.implicit, syncs.per_batch) == (3, 3, 0, 1.0)
