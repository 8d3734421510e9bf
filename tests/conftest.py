"""Shared fixtures: one demo build per test session (real photos, tiny checkpoint), built in a temp home."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

import forked

# Set before batchvlm is imported anywhere, so tests and the subprocesses they start share one build.
os.environ.setdefault("BATCHVLM_HOME", tempfile.mkdtemp(prefix="batchvlm-home-"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    # An xdist worker's torch ops (and the processes it starts) on its share of the cores: OpenMP's threads beyond
    # the cores spin while they wait. Two workers of two threads each on two cores spent twice the CPU time on the
    # same tests (docs/design.md, Tests).
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0))
                                                     // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

REPO = Path(__file__).resolve().parents[1]
PLUGINS = Path(__file__).resolve().parent / "families" / "plugins"
"""A family from outside batchvlm (framed_moonvit.py) and its YAML (conf/model/), found as a user's own would be: the
module on the Python path (the tests' and the jobs' they start), the YAML on Hydra's search path (PLUGIN_SEARCHPATH)."""
PLUGIN_FAMILY = "framed_moonvit"
PLUGIN_SEARCHPATH = f"hydra.searchpath=[file://{PLUGINS / 'conf'}]"
sys.path.insert(0, str(PLUGINS))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PLUGINS), os.environ.get("PYTHONPATH")]))


SLOW_FOLDER = "slow"
"""The unit part (`-m "not slow"`) is every test outside the rooms' slow/ folders: a slow test (the job as a process,
full models, benches, the Triton interpreter) lives in its room's slow/ folder, and a file there holds only slow tests
(pytest_collection_modifyitems checks both, docs/design.md's Tests)."""


# Every room's folder and its slow/ folder on the path (pytest puts a test file's folder there only as it imports it):
# a test file imports another's helpers by module name wherever the two lie (test_export_commands from test_export).
sys.path[1:1] = [str(folder) for folder in sorted([*Path(__file__).parent.glob("*/"),
                                                   *Path(__file__).parent.glob(f"*/{SLOW_FOLDER}")])
                 if folder.is_dir() and folder.name != "__pycache__"]


def in_slow_folder(item: pytest.Item) -> bool:
    return SLOW_FOLDER in item.path.relative_to(Path(__file__).parent).parts[:-1]


def misplaced_tests(items: list[pytest.Item]) -> list[str]:
    """The tests that disagree with their place: in slow/ and not marked slow, or marked slow elsewhere."""
    return [f"{item.path.relative_to(REPO)}::{item.name}: " + ("in slow/ and not marked slow" if in_slow_folder(item) else
                                                            "marked slow: it belongs in its room's slow/ folder")
            for item in items if (item.get_closest_marker("slow") is not None) != in_slow_folder(item)]


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: the check sees every collected test
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests checked against their place; then the slow/ files first (in their rooms' order), the unit files last.
    xdist (`--dist loadfile`, `--no-loadscope-reorder`) hands the files out in this order as each worker frees up: the
    longest files start first, and the short ones at the end even out the workers, where a single-test file of a
    minute handed out last would leave one worker idle."""
    if misplaced := misplaced_tests(items):
        raise pytest.UsageError("tests in the wrong place for their kind:\n" + "\n".join(misplaced))
    items.sort(key=lambda item: not in_slow_folder(item))


def shared_folder(name: str) -> Path:
    """A folder of the project's shared/ (the corpus), which sits beside the checkout, not in it.

    CI names shared/ in $BATCHVLM_SHARED (.ci/run), taken from the checkout's path as the shell sees it: REPO is
    resolved, and a checkout reached through a symlink resolves to another parent than the one shared/ was put
    beside. Named there and missing, the test fails; a user's clone without shared/ skips it, saying where it looked.
    """
    named = os.environ.get("BATCHVLM_SHARED")
    folder = Path(named or REPO.parent / "shared") / name
    if not folder.is_dir():
        if named:
            pytest.fail(f"{folder} is missing, and BATCHVLM_SHARED={named} says shared/ is there")
        pytest.skip(f"no {folder} (set BATCHVLM_SHARED to the shared/ folder)")
    return folder


def quarantine_rows(run_dir: Path) -> list[dict]:
    """id, check, stage and source of every row in the run's quarantine folder."""
    import pyarrow.parquet as pq

    return [row for path in sorted((run_dir / "quarantine").glob("*.parquet"))
            for row in pq.read_table(path, columns=["id", "check", "stage", "source"]).to_pylist()]


def data_ids(run_dir: Path) -> set[str]:
    """The ids in the run's data folder."""
    import pyarrow.parquet as pq

    return {row["id"] for path in (run_dir / "data").glob("*.parquet")
            for row in pq.read_table(path, columns=["id"]).to_pylist()}


def run_training_doc_recipe(heading: str, run_dir: Path) -> dict:
    """The first python block under `heading` in docs/training.md, run as a reader copies it, with the demo's run
    folder replaced by `run_dir`: its variables (it writes where the test runs)."""
    page = (REPO / "docs" / "training.md").read_text()
    section = page[page.index(heading):]
    start = section.index("```python") + len("```python")
    scope: dict = {}
    exec(section[start:section.index("```\n", start)].replace('"outputs/demo-qwen2_vl_tiny"', repr(str(run_dir))), scope)
    return scope


def job_command(job: str, *args: str) -> list[str]:
    """`python jobs/<job>.py args...` as a user runs it."""
    return [sys.executable, str(REPO / "jobs" / f"{job}.py"), *args]


def embed_command(*overrides: str) -> list[str]:
    return job_command("embed", *overrides)


def run_job_command(job: str, *args: str, cwd: Path | None = None, env: dict | None = None,
                    timeout: float = 600) -> subprocess.CompletedProcess:
    """`python jobs/<job>.py args...` run to its end as its own process, forked from the suite's zygote
    (tests/forked.py): subprocess.run's result, stdout and stderr as text."""
    return forked.run(job_command(job, *args), cwd=cwd or REPO, env=env, timeout=timeout)


def start_embed(*overrides: str, env: dict | None = None, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session: bool = False) -> forked.ForkedProcess:
    """The embed job started as its own process (forked from the suite's zygote), left running: Popen's own."""
    return forked.ForkedProcess(embed_command(*overrides), cwd=REPO, env=env, stdout=stdout, stderr=stderr,
                                start_new_session=start_new_session)


def free_port() -> int:
    """A TCP port free on this host now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def accelerate_command(*overrides: str) -> list[str]:
    """The embed job as two processes on the CPU under `accelerate launch --multi_gpu`, on a port of their own: two
    launches at once (two xdist workers) must not both take accelerate's default 29500."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
            "--num_machines", "1", "--main_process_port", str(free_port()), "--mixed_precision", "no",
            "--dynamo_backend", "no", str(REPO / "jobs" / "embed.py"), "model.device=cpu", *overrides]


def run_ranks(*overrides: str, ranks: int = 2, timeout: float = 600) -> list[subprocess.CompletedProcess]:
    """The embed job on the CPU as `ranks` processes of one torch.distributed group, each forked from the suite's
    zygote with the rendezvous variables torchrun gives its workers (which accelerate's PartialState reads): for tests
    of what several ranks do to one run. That `accelerate launch` starts the job so, test_distributed.py proves. As a
    launcher does, a rank that fails ends the others (they would wait for it in the group)."""
    group = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(ranks),
             "LOCAL_WORLD_SIZE": str(ranks)}
    jobs = [forked.ForkedProcess(embed_command("model.device=cpu", *overrides), cwd=REPO,
                                 env={**group, "RANK": str(rank), "LOCAL_RANK": str(rank)}) for rank in range(ranks)]
    deadline = time.monotonic() + timeout
    try:
        while any(job.poll() is None for job in jobs) and not any(job.poll() for job in jobs):
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(jobs[0].args, timeout)
            time.sleep(0.1)
    finally:
        for job in jobs:
            job.kill()
    ends = [job.communicate() for job in jobs]
    return [subprocess.CompletedProcess(job.args, job.returncode, *end) for job, end in zip(jobs, ends)]


def composed_job(root: Path, run_name: str, *overrides: str):
    """The embed job's JobConfig for these overrides, as its entry point composes and validates it."""
    from hydra import compose, initialize_config_module

    from batchvlm.config import to_job_config
    from batchvlm.executor.config import JobConfig, register_schemas

    register_schemas()
    with initialize_config_module("batchvlm.conf", version_base=None):
        cfg = compose(config_name="embed", overrides=[f"output.root={root}", f"run_name={run_name}", *overrides])
    return to_job_config(cfg, JobConfig)


def summary_in_process(root: Path, run_name: str, *overrides: str) -> dict:
    """A run of the embed job in this process (its workers and decoder as the job starts them): for tests of what the
    output holds, where the job's own process proves nothing more. Rank 0's summary, which the job prints as it ends;
    what the job's exit 0 says is that run_job returned it (it raises for what the job exits non-zero for)."""
    from batchvlm.executor.job import run_job

    return run_job(composed_job(root, run_name, *overrides), root / run_name)


def embed_in_process(root: Path, run_name: str, *overrides: str) -> Path:
    """summary_in_process's run directory."""
    summary_in_process(root, run_name, *overrides)
    return root / run_name


def refused_in_process(root: Path, *overrides: str, run_name: str = "refused") -> str:
    """What the embed job refuses before any work, found by its own steps in this process (Hydra's compose, the schema's
    validation, run_job): the ConfigError's message, which the job prints as its one line before exit 2. Nothing is
    left under `root` that was not there before. That the process then exits 2, removing the run folder Hydra made, a
    subprocess test proves once (tests/executor/slow/test_refusals_of_the_job.py)."""
    from batchvlm.config import ConfigError
    from batchvlm.executor.job import run_job

    before = sorted(root.rglob("*"))
    with pytest.raises(ConfigError) as refused:
        run_job(composed_job(root, run_name, *overrides), root / run_name)
    assert sorted(root.rglob("*")) == before
    return str(refused.value)


def run_embed(*overrides: str, cwd: Path | None = None, env: dict | None = None,
              timeout: int = 600) -> subprocess.CompletedProcess:
    return run_job_command("embed", *overrides, cwd=cwd, env=env, timeout=timeout)


def run_embed_measured(*overrides: str, timeout: int = 600) -> tuple[subprocess.CompletedProcess, float]:
    """run_embed in a fresh interpreter (a forked one shares the zygote's pages), and the peak RSS in GiB of the job's
    own processes: os.wait4 of the job reports it and the children it reaped (its workers, its decoder), where
    RUSAGE_CHILDREN would be the largest child of the whole test session so far."""
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        job = subprocess.Popen(embed_command(*overrides), cwd=REPO, stdout=stdout, stderr=stderr, text=True)
        deadline = threading.Timer(timeout, job.kill)
        deadline.start()
        try:
            _, status, usage = os.wait4(job.pid, 0)
        finally:
            deadline.cancel()
        job.returncode = os.waitstatus_to_exitcode(status)
        stdout.seek(0)
        stderr.seek(0)
        return subprocess.CompletedProcess(job.args, job.returncode, stdout.read(), stderr.read()), \
            usage.ru_maxrss / 2**20


@pytest.fixture(scope="session")
def kimi_family():
    from batchvlm.families import ModelConfig
    from batchvlm.families import load_family

    return load_family(ModelConfig())


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory) -> Path:
    """The demo job, run once as a process with default settings (forked: a fresh interpreter runs the installed job
    on the demo in tests/bench/slow/test_tasks_runs.py)."""
    root = tmp_path_factory.mktemp("outputs")
    result = run_embed(f"output.root={root}", "run_name=demo")
    assert result.returncode == 0, result.stderr[-4000:]
    return root / "demo"


def all_families() -> list[str]:
    """Every family batchvlm finds, and the one from outside it: each test over families runs over all of them."""
    from batchvlm.families import family_names

    return family_names() + [PLUGIN_FAMILY]


@pytest.fixture(scope="session", params=all_families())
def family(request):
    """Each family with its tiny demo checkpoint."""
    from batchvlm.families import ModelConfig
    from batchvlm.families import load_family

    return load_family(ModelConfig(family=request.param))


# -- runs the training tests and the loader bench read --------------------------------------------------
def committed_shards(run_dir, kind: str = "data") -> list[Path]:
    """The shards the run's manifests list, as a reader trusts them."""
    from batchvlm.rundir.layout import RunLayout
    from batchvlm.rundir.manifest import listed_shards

    return [shard for _, shard in listed_shards(RunLayout(Path(run_dir)), kind)]


def relist(run_dir, shard) -> None:
    """The manifest listing a rewritten shard says the shard's new size and sha256 (as if the job wrote it so)."""
    import dataclasses
    import json

    from batchvlm.rundir.durable import sha256_file
    from batchvlm.rundir.layout import RunLayout
    from batchvlm.rundir.manifest import all_manifests

    layout = RunLayout(Path(run_dir))
    for manifest in all_manifests(layout):
        files = {kind: [dataclasses.replace(listing, bytes=Path(shard).stat().st_size, sha256=sha256_file(shard))
                        if layout.listed(listing.path) == Path(shard) else listing for listing in listings]
                 for kind, listings in manifest.files.items()}
        layout.manifest(manifest.unit).write_text(json.dumps(dataclasses.replace(manifest, files=files).to_json()))


@pytest.fixture(scope="session")
def qwen_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("outputs")
    return embed_in_process(root, "qwen", "model=qwen2_vl_tiny")


@pytest.fixture(scope="session")
def records(qwen_run):
    from batchvlm.training.reader import read_run

    return list(read_run(qwen_run))


@pytest.fixture(scope="session")
def siglip_run(tmp_path_factory) -> Path:
    """A run with an embedding column beside image_embeds: SigLIP2's pooled_embeds, one vector per image."""
    root = tmp_path_factory.mktemp("outputs")
    return embed_in_process(root, "siglip", "model=siglip2_tiny", "dataset.limit=6")


@pytest.fixture(scope="session")
def clip_run(tmp_path_factory) -> Path:
    """The demo's clips (dataset=demo_clips) through Qwen2-VL: a clip alone, a clip and an image, two clips, and a cut
    clip quarantined; where the features that meet clips (export, serving, push, TRL) are tried on them."""
    root = tmp_path_factory.mktemp("outputs")
    return embed_in_process(root, "clips", "dataset=demo_clips", "model=qwen2_vl_tiny")


# -- Qwen2-VL's real vocabulary (tests/qwen_vocab.py) ---------------------------------------------------------------
@pytest.fixture(scope="session")
def qwen_real_checkpoint() -> Path:
    """A Qwen2-VL checkpoint folder with the real tokenizer and an LLM over its vocabulary; the tiny demo checkpoint's
    tower. Built once for the session's workers (5 s), beside the tiny checkpoints; the tests only read it."""
    import qwen_vocab
    from batchvlm.demo import build_once, home
    from batchvlm.families import tiny_checkpoint

    return build_once(home() / "tests" / "qwen2_vl_real_vocab",
                      lambda folder: qwen_vocab.write_checkpoint(folder, tiny_checkpoint("qwen2_vl")))


@pytest.fixture(scope="session")
def qwen_real(qwen_real_checkpoint):
    """The qwen2_vl family over that checkpoint, as `model.path` loads it."""
    from batchvlm.families import ModelConfig
    from batchvlm.families import load_family

    return load_family(ModelConfig(family="qwen2_vl", path=str(qwen_real_checkpoint)))


LLAVA_ANSWER = ("It is a photograph, and here is a long description of it: "
                + "the colours, the light, the shapes. " * 12)


def llava_records() -> list[dict]:
    """LLaVA records over image files: multi-turn and multi-image, text only, one longer than the run's
    text.max_tokens (it loses whole trailing turns), one whose roles are out of order (quarantined)."""
    return [
        {"id": "two_photos", "image": ["img/cat.png", "img/coffee.jpg"], "conversations": [
            {"from": "human", "value": "Compare <image> with\n<image> -- which is older (1999 or 2024)?"},
            {"from": "gpt", "value": "The first:  from 1999."},
            {"from": "human", "value": "And the cup?"},
            {"from": "gpt", "value": "2024, café-style."}]},
        {"id": "text_only", "conversations": [{"from": "human", "value": "What is 12+30?"},
                                              {"from": "gpt", "value": "42."}]},
        {"id": "long", "image": "img/rocket.jpg", "conversations": [
            {"from": "human", "value": "<image>\nDescribe it."}, {"from": "gpt", "value": "A rocket. " + LLAVA_ANSWER},
            {"from": "human", "value": "More?"}, {"from": "gpt", "value": LLAVA_ANSWER},
            {"from": "human", "value": "Even more?"}, {"from": "gpt", "value": LLAVA_ANSWER}]},
        {"id": "answer_first", "image": "img/cat.png", "conversations": [
            {"from": "gpt", "value": "<image> I speak first."}, {"from": "human", "value": "Why?"}]},
    ]


LLAVA_MAX_TOKENS = 400


def write_llava_dataset(folder: Path) -> Path:
    """The records as LLaVA ships them: one JSON array, image paths relative to the images' root."""
    import json

    from PIL import Image
    from skimage import data

    (folder / "img").mkdir(parents=True)
    for name, pixels in (("cat.png", data.chelsea()[::3, ::3]), ("coffee.jpg", data.coffee()[::4, ::4]),
                         ("rocket.jpg", data.rocket()[::4, ::4])):
        Image.fromarray(pixels).save(folder / "img" / name)
    (folder / "llava.json").write_text(json.dumps(llava_records(), indent=1, ensure_ascii=False))
    return folder / "llava.json"


@pytest.fixture(scope="session")
def llava_dataset(tmp_path_factory) -> Path:
    return write_llava_dataset(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="session")
def llava_run(tmp_path_factory, qwen_real_checkpoint, llava_dataset) -> Path:
    """The job on LLaVA records with Qwen2-VL's real vocabulary, its stored embeddings in fp32 from the HF processor's
    pixels (so the training oracle compares the stored output alone)."""
    root = tmp_path_factory.mktemp("outputs")
    return embed_in_process(root, "llava", "dataset=llava", f"dataset.path={llava_dataset}", "model=qwen2_vl_tiny",
                            f"model.path={qwen_real_checkpoint}", "output.embed_dtype=float32",
                            "preprocess.backend=reference", f"text.max_tokens={LLAVA_MAX_TOKENS}",
                            "text.overflow=drop_turns")
