"""`batchvlm-push`: a finished run's data shards and its dataset card, uploaded to a Hugging Face Hub dataset repo.

What is uploaded: exactly the data shards the manifests list (never a listing of data/, which can hold a crashed
attempt's files), each as it is (no re-encoding: the bytes the manifest's sha256 names), and the card (card.py) that
lists them. Not the quarantine shards: they hold the failing inputs' own bytes and texts as evidence, other people's
data that the card's license does not cover, and they are no training rows; the card gives their counts by check.

The one exception: a shard holding later occurrences of an id, which the duplicate pass listed and batchvlm's readers
leave out, is published as a copy without them (the Hub's readers could not skip them), written into
`<run>/push.staging/` for the push and removed after it; the copy is the same bytes from push to push.

The shards go into the repo as `data/<NNNNN>/<file>`, a folder per SHARDS_PER_FOLDER shards in read order: the Hub
wants under 10k entries a folder. Before anything is uploaded the run is refused if it is unfinished (its totals,
written last, are not there: it is still being written), written in another output format, or has a listed shard
missing, of another size, over the Hub's file size limit or with a row group over the dataset viewer's limit. Then
each shard to upload is hashed and compared with its manifest's sha256, all before the first commit: a damaged shard
is refused by name and nothing is committed. The hash is the one its `CommitOperationAdd` computes (lazily) and gives
the Hub as the LFS oid, so it is computed once; the upload reads the file a second time to send it. A shard already
on the Hub is not read at all: the Hub's sha256 of it is its manifest's. (`batchvlm-verify` checks the rest of a run's
contract: ids, counts, the duplicate pass.)

Resumable: the repo's files are listed first, with the sha256 the Hub keeps of each LFS file; a shard already there
with its manifest's sha256 is not uploaded again, and the card is committed only when its bytes differ (its git blob
id). So a push that died after some commits uploads only the rest, and a second push of an unchanged run commits
nothing. The shards go in commits of `files_per_commit` (the Hub recommends under 100 files a commit), each named
for what it holds; the card comes last, so it never lists a file the repo does not have.

Concurrent pushes: a push holds `<run>/push.lock`, published exclusively (a hard link, as claims are), so a second
push of the same run is refused naming the holder; a lock whose process is gone from this host is taken over, any
other is left to the user to remove (the message says which file). Pushes of other runs, or edits, to the same repo
are caught on the Hub: every commit names its parent (`parent_commit`), and the Hub refuses it if the branch moved.
A lock on the Hub instead would cost two commits a push, and a crashed push would leave it in the repo for everyone.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchvlm.config import Choice, Config, ConfigError, positive
from batchvlm.format.schema import FormatError
from batchvlm.publish.card import RunFacts, dataset_card
from batchvlm.rundir.claims import gone_from_this_host
from batchvlm.rundir.dedup import excluded_rows
from batchvlm.rundir.durable import publish_exclusive, read_json, temporary_name
from batchvlm.rundir.layout import DATA, RunLayout
from batchvlm.rundir.manifest import DamagedFile, Listing, all_manifests, checked, sha256_differs
from batchvlm.rundir.upgrade import check_run_format, compression_of, run_format

log = logging.getLogger("batchvlm")

CARD = "README.md"
REPO_TYPE = "dataset"
BRANCH = "main"
SHARDS_PER_FOLDER = 1000
"""Shards per folder of the repo (the Hub recommends fewer than 10k entries a folder)."""
MAX_FILES_PER_COMMIT = 99
"""The Hub recommends fewer than 100 files a commit."""
MAX_FILE_BYTES = 50 * 10 ** 9
"""The Hub's largest file (50 GB; under 20 GB recommended): output.shard_bytes keeps shards far below it."""
VIEWER_ROW_GROUP_BYTES = 300_000_000
"""The dataset viewer reads a row group whole and refuses one over this size in memory ("Rows from parquet row groups
are too big to be read: ... (max=286.10 MiB)"). batchvlm's sink cuts its row groups at 64 MB, so a group over it holds
one record that large alone (a long clip's tokens), which no smaller row group would hold, or was written by something
else: it is refused, naming the shard and the group, not rewritten."""
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}$")
LICENSE = re.compile(r"^[a-z0-9][a-z0-9.+-]*$")


class Visibility(Choice):
    private = "private"
    public = "public"


@dataclass
class PushConfig(Config):
    """`batchvlm-push`: which run goes to which dataset repo."""

    run_dir: str = "???"
    """The finished run directory to publish."""
    repo_id: str = "???"
    """The dataset repo, `<user or org>/<name>`; created if it does not exist."""
    license: str = "???"
    """The published dataset's license, a Hub license id (cc-by-4.0, apache-2.0, other, ...): the source's terms
    decide it, so it is never assumed."""
    visibility: Visibility = Visibility.private
    """private | public: of a repo the push creates (an existing repo keeps its own)."""
    files_per_commit: int = 50
    """Shards per commit (1 to 99)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not REPO_ID.match(self.repo_id):
            raise ConfigError(f"repo_id={self.repo_id!r} is not a Hub repo id: <user or org>/<name>")
        if not LICENSE.match(self.license):
            raise ConfigError(f"license={self.license!r} is not a Hub license id (cc-by-4.0, apache-2.0, other, ...)")
        positive("files_per_commit", self.files_per_commit)
        if self.files_per_commit > MAX_FILES_PER_COMMIT:
            raise ConfigError(f"files_per_commit={self.files_per_commit} is over {MAX_FILES_PER_COMMIT}: the Hub "
                              "recommends under 100 files a commit")
        # A run of an older format (one from before the marker too) is a run: the push refuses it as the readers do,
        # naming the upgrade.
        if run_format(RunLayout(Path(self.run_dir))) is None:
            raise ConfigError(f"run_dir={self.run_dir!r} is not a batchvlm run directory (no .batchvlm marker)")


class PushRefused(RuntimeError):
    """The run cannot be published as it is, or another push holds it: the message names what and why."""


@dataclass(frozen=True)
class Shard:
    """A data shard of the run, as its manifest lists it, and where it goes in the repo."""

    listing: Listing
    repo_path: str
    skipped: frozenset[int] = frozenset()  # input rows of later occurrences of an id: published without them


@dataclass(frozen=True)
class RemoteFile:
    size: int
    sha256: str | None  # an LFS file's, as the Hub keeps it
    blob_id: str  # the git blob id: of the content for a plain file (the card), of the pointer for an LFS one


@dataclass(frozen=True)
class PushResult:
    repo_id: str
    shards: int  # the run's data shards
    uploaded: list[str]  # repo paths committed by this push (shards, then the card)
    commits: list[str]  # commit messages, in order
    unreferenced: list[str]  # files under data/ in the repo that the card does not list (left as they are)


def published_shards(layout: RunLayout) -> list[Shard]:
    """Every data shard the manifests list, in read order (read_run's), each with its place in the repo and the rows
    the readers leave out of it."""
    excluded = excluded_rows(layout)
    listings = [(manifest.unit, listing) for manifest in all_manifests(layout) for listing in manifest.shards(DATA)]
    return [Shard(listing, f"data/{index // SHARDS_PER_FOLDER:05d}/{Path(listing.path).name}",
                  frozenset(excluded.get(unit, ()))) for index, (unit, listing) in enumerate(listings)]


def refuse_unpublishable(layout: RunLayout) -> None:
    """A run that is unfinished or in another output format: PushRefused, before anything is read or uploaded."""
    totals = read_json(layout.success)
    if totals is None:
        raise PushRefused(f"{layout.root} has no {layout.name_of(layout.success)}: the run is unfinished or still "
                          "being written; finish it (rerun the embed job on it), then push")
    try:
        check_run_format(layout)
    except FormatError as error:
        raise PushRefused(str(error)) from None


def oversized_row_groups(path: Path, footer: pq.FileMetaData, limit: int = VIEWER_ROW_GROUP_BYTES) -> list[str]:
    """Each row group of a shard over `limit` bytes in memory, named; from its footer alone."""
    return [f"{path}: row group {group} is {size:,} bytes in memory, over the dataset viewer's {limit:,}"
            for group in range(footer.num_row_groups)
            if (size := footer.row_group(group).total_byte_size) > limit]


def publishable_footers(layout: RunLayout, shards: list[Shard],
                        row_group_limit: int = VIEWER_ROW_GROUP_BYTES) -> list[pq.FileMetaData]:
    """Each shard's Parquet footer, read once: its row groups are checked here and the card's facts read from it.
    PushRefused naming every shard that cannot be published, from its size and footer (no shard is hashed here)."""
    problems, footers = [], []
    for shard in shards:
        try:
            path = checked(layout, shard.listing)
        except DamagedFile as error:
            problems.append(str(error))
            continue
        if shard.listing.bytes > MAX_FILE_BYTES:
            problems.append(f"{path}: {shard.listing.bytes:,} bytes, over the Hub's {MAX_FILE_BYTES:,} a file")
        try:
            footers.append(pq.read_metadata(path))
        except (OSError, pa.ArrowException) as error:  # bytes changed in place, of the same size
            problems.append(f"{path}: its Parquet footer does not read ({error}): verify the run, or rerun it")
            continue
        problems += oversized_row_groups(path, footers[-1], row_group_limit)
    if problems:
        raise PushRefused("shards that cannot be published, nothing uploaded:\n" + "\n".join(problems))
    return footers


def git_blob_id(content: bytes) -> str:
    """The id git (and the Hub's tree listing) gives a file of this content."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


def remote_files(api, repo_id: str) -> dict[str, RemoteFile]:
    """Every file of the repo's branch, with its LFS sha256 where it has one: one paginated listing."""
    from huggingface_hub.hf_api import RepoFile

    return {entry.path: RemoteFile(entry.size, entry.lfs.sha256 if entry.lfs else None, entry.blob_id)
            for entry in api.list_repo_tree(repo_id, recursive=True, repo_type=REPO_TYPE, revision=BRANCH)
            if isinstance(entry, RepoFile)}


def verified_uploads(layout: RunLayout, shards: list[Shard], staged: dict[str, object]) -> list:
    """A commit operation per shard: its staged copy's (`staged_copies`), or the shard's own, its sha256 (which the
    operation computes once, on first use, and keeps for the upload) checked against its manifest's: PushRefused
    naming every shard that differs, before any commit."""
    from huggingface_hub import CommitOperationAdd

    operations, damaged = [], []
    for shard in shards:
        if shard.repo_path in staged:
            operations.append(staged[shard.repo_path])
            continue
        path = layout.listed(shard.listing.path)
        operation = CommitOperationAdd(shard.repo_path, path)
        if operation.upload_info.sha256.hex() != shard.listing.sha256:
            damaged.append(str(sha256_differs(path)))
        operations.append(operation)
    _refuse_damaged(damaged)
    return operations


def _refuse_damaged(damaged: list[str]) -> None:
    if damaged:
        raise PushRefused("damaged shards, nothing uploaded (verify the run, or rerun it: the units are redone):\n"
                          + "\n".join(damaged))


def staged_copies(layout: RunLayout, shards: list[Shard]) -> dict[str, object]:
    """Each shard with rows the readers leave out (later occurrences of an id, which the duplicate pass listed but
    the Hub's readers cannot skip), checked against its manifest's sha256 and written again without them into
    `<run>/push.staging/`: its commit operation, by repo path. The copy is written the same way each time (the
    shard's row groups in order, its schema, metadata and codec), so its sha256 too is the same from push to push."""
    from huggingface_hub import CommitOperationAdd

    staging = layout.push_staging
    shutil.rmtree(staging, ignore_errors=True)  # a killed push's copies: this push holds the lock now
    staged, damaged = {}, []
    for shard in shards:
        if not shard.skipped:
            continue
        try:
            source = checked(layout, shard.listing, checksums=True)
        except DamagedFile as error:
            damaged.append(str(error))
            continue
        staging.mkdir(exist_ok=True)
        copy = write_without_rows(source, staging / source.name, shard.skipped)
        staged[shard.repo_path] = CommitOperationAdd(shard.repo_path, copy)
    _refuse_damaged(damaged)
    return staged


def write_without_rows(source: Path, target: Path, skipped: frozenset[int]) -> Path:
    """`source` written to `target` without the records of the input rows `skipped`, a row group at a time."""
    file = pq.ParquetFile(source)
    drop = pa.array(sorted(skipped), pa.int64())
    with pq.ParquetWriter(target, file.schema_arrow, compression=compression_of(file)) as writer:
        for group in range(file.num_row_groups):
            table = file.read_row_group(group)
            kept = table.filter(pc.invert(pc.is_in(table.column("row"), value_set=drop)))
            if kept.num_rows:
                writer.write_table(kept)
    return target


@contextmanager
def push_lock(layout: RunLayout, repo_id: str) -> Iterator[None]:
    """Hold `<run>/push.lock` for the push: published exclusively, so of two pushes of one run exactly one runs. A lock
    whose process is gone from this host is taken over; any other refuses the push, naming its holder and the file."""
    lock = layout.push_lock
    holder = {"host": socket.gethostname(), "pid": os.getpid(), "repo_id": repo_id, "since": time.time()}
    if not _publish_lock(lock, holder):
        if not gone_from_this_host(lock):
            raise PushRefused(_held_by(lock))
        log.warning("%s was left by a push whose process is gone (%s): taking it over", lock, _holder_of(lock))
        lock.unlink(missing_ok=True)
        if not _publish_lock(lock, holder):
            raise PushRefused(_held_by(lock))
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)


def _publish_lock(lock: Path, holder: dict) -> bool:
    tmp = temporary_name(lock)
    try:
        tmp.write_text(json.dumps(holder))
        return publish_exclusive(tmp, lock)
    except OSError as error:  # a run directory mounted read-only, say
        tmp.unlink(missing_ok=True)
        raise PushRefused(f"cannot write {lock} ({error}): a push holds it while it uploads, so that two pushes of "
                          "the run never run at once; push from where the run directory is writable") from None


def _holder_of(lock: Path) -> str:
    try:
        holder = json.loads(lock.read_text())
        return (f"pid {holder['pid']} on {holder['host']}, pushing to {holder['repo_id']} since "
                f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(holder['since']))}")
    except (OSError, ValueError, KeyError, TypeError):
        return "a holder it does not name (unreadable)"


def _held_by(lock: Path) -> str:
    return (f"another push holds this run: {lock} ({_holder_of(lock)}); if that push is no longer running, remove "
            f"{lock} and push again")


def _commit(api, repo_id: str, operations: list, message: str, parent: str) -> str:
    """One commit on top of `parent`, the Hub refusing it if the branch moved since; the new head."""
    from huggingface_hub.errors import HfHubHTTPError

    try:
        return api.create_commit(repo_id, operations, commit_message=message, repo_type=REPO_TYPE, revision=BRANCH,
                                 parent_commit=parent).oid
    except HfHubHTTPError:
        if _head(api, repo_id) != parent:
            raise PushRefused(f"{repo_id}: its {BRANCH} branch moved during this push (another push or an edit of "
                              "the repo); push again to resume from what is there") from None
        raise


def _head(api, repo_id: str) -> str:
    return api.repo_info(repo_id, repo_type=REPO_TYPE, revision=BRANCH).sha


def push_run(config: PushConfig, api=None) -> PushResult:
    """Publish the run of `config` to its repo through `api` (an `HfApi`; by default one with the environment's token
    and endpoint). Everything that can refuse the run does so before the first commit."""
    layout = RunLayout(Path(config.run_dir))
    refuse_unpublishable(layout)
    shards = published_shards(layout)
    if not shards:
        raise PushRefused(f"{layout.root}: no data shard (every record was quarantined): nothing to publish")
    card = dataset_card(RunFacts.of(layout, publishable_footers(layout, shards)), [shard.repo_path for shard in shards],
                        config.license)
    with push_lock(layout, config.repo_id):
        if api is None:
            from huggingface_hub import HfApi

            api = HfApi()
        try:
            return _upload(api, config, layout, shards, staged_copies(layout, shards), card)
        finally:
            shutil.rmtree(layout.push_staging, ignore_errors=True)


def _upload(api, config: PushConfig, layout: RunLayout, shards: list[Shard], staged: dict, card: str) -> PushResult:
    from huggingface_hub import CommitOperationAdd

    api.create_repo(config.repo_id, repo_type=REPO_TYPE, private=config.visibility == Visibility.private,
                    exist_ok=True)
    head = _head(api, config.repo_id)
    remote = remote_files(api, config.repo_id)
    published = {path: operation.upload_info.sha256.hex() for path, operation in staged.items()}
    missing = [shard for shard in shards if (found := remote.get(shard.repo_path)) is None
               or found.sha256 != published.get(shard.repo_path, shard.listing.sha256)]
    operations = verified_uploads(layout, missing, staged)
    commits, uploaded = [], []
    step = config.files_per_commit
    for start in range(0, len(operations), step):
        batch = operations[start:start + step]
        message = (f"batchvlm-push {layout.root.name}: data shards {start + 1}-{start + len(batch)} of the "
                   f"{len(missing)} missing ({len(shards)} in the run)")
        head = _commit(api, config.repo_id, batch, message, head)
        commits.append(message)
        uploaded += [operation.path_in_repo for operation in batch]
    card_bytes = card.encode()
    if (found := remote.get(CARD)) is None or found.blob_id != git_blob_id(card_bytes):
        message = f"batchvlm-push {layout.root.name}: dataset card listing {len(shards)} data files"
        _commit(api, config.repo_id, [CommitOperationAdd(CARD, card_bytes)], message, head)
        commits.append(message)
        uploaded.append(CARD)
    listed = {shard.repo_path for shard in shards}
    unreferenced = sorted(path for path in remote if path.startswith("data/") and path not in listed)
    return PushResult(config.repo_id, len(shards), uploaded, commits, unreferenced)


def format_push(result: PushResult) -> str:
    if not result.commits:
        done = f"OK {result.repo_id}: already up to date ({result.shards} data shards and the card), nothing committed"
    else:
        shards = len(result.uploaded) - (CARD in result.uploaded)
        card = " and the card" if CARD in result.uploaded else ""
        done = (f"OK {result.repo_id}: {shards} of {result.shards} data shards uploaded{card} in "
                f"{len(result.commits)} commits")
    if result.unreferenced:
        done += (f"\n{len(result.unreferenced)} files under data/ in the repo are not this run's; the card does not "
                 f"list them, so no reader loads them (first: {result.unreferenced[0]})")
    return done
