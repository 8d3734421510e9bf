"""A local stand-in for the Hub, behind huggingface_hub's own API: `HfApi` with the calls batchvlm-push makes
(create_repo, repo_info, list_repo_tree, create_commit) answered from a folder instead of the network.

It keeps what the Hub keeps and answers as the Hub does where the push depends on it: a new repo starts with a commit of
the Hub's default `.gitattributes` (Parquet files are LFS); the tree listing gives a plain file's git blob id and an LFS
file's sha256 and size; a commit whose `parent_commit` is not the branch's head is refused with 412, and one that
changes nothing makes no commit. The operations are huggingface_hub's own `CommitOperationAdd`s, read from the path
or bytes they were built with. Each repo's files are a plain folder (`folder(repo_id)`), what `load_dataset` reads;
its commits are kept beside it, so a push in another process (one killed midway) leaves the hub as the Hub would.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import httpx2
from huggingface_hub import CommitOperationAdd, HfApi
from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError
from huggingface_hub.hf_api import CommitInfo, DatasetInfo, RepoFile, RepoFolder

STATE = ".hub"
"""Under the hub's root, each repo's commits (`<owner>/<name>.json`): a later FakeHub on the same root (another process)
finds the repos as the Hub would. The repos' files are beside it, `<owner>/<name>/`."""
GITATTRIBUTES = b"*.parquet filter=lfs diff=lfs merge=lfs -text\n*.arrow filter=lfs diff=lfs merge=lfs -text\n"
"""The LFS patterns of the Hub's default .gitattributes that matter here (it lists many more binary formats)."""


def _error(kind, status: int, message: str, url: str):
    response = httpx2.Response(status, request=httpx2.Request("POST", url))
    return kind(message, response=response)


def git_blob_id(content: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


@dataclass
class Commit:
    oid: str
    message: str
    paths: list[str]


@dataclass
class Repo:
    folder: Path
    private: bool
    commits: list[Commit] = field(default_factory=list)

    @property
    def head(self) -> str:
        return self.commits[-1].oid


class FakeHub(HfApi):
    """`fail_at_commit=n`: the n-th commit call (1-based, counted over the hub's life) dies as a push killed there
    would (ConnectionError, nothing written). `before_commit`: a callable run before each commit (another writer)."""

    def __init__(self, root: Path, fail_at_commit: int | None = None):
        super().__init__(endpoint="http://fake-hub.invalid", token=False)
        self.root = root
        self.repos: dict[str, Repo] = {}
        self.commit_calls = 0
        self.fail_at_commit = fail_at_commit
        self.before_commit = None
        for state in sorted((root / STATE).glob("*/*.json")):  # what earlier processes committed, as the Hub keeps it
            repo_id = state.relative_to(root / STATE).with_suffix("").as_posix()
            saved = json.loads(state.read_text())
            self.repos[repo_id] = Repo(root / repo_id, saved["private"],
                                       [Commit(**commit) for commit in saved["commits"]])

    def folder(self, repo_id: str) -> Path:
        return self.repos[repo_id].folder

    def commits(self, repo_id: str) -> list[Commit]:
        return self.repos[repo_id].commits

    # -- the Hub's API, as the push calls it ------------------------------------------------------
    def create_repo(self, repo_id, *, repo_type=None, private=None, exist_ok=False, **_):
        assert repo_type == "dataset"
        if repo_id in self.repos:
            if not exist_ok:
                raise _error(HfHubHTTPError, 409, "You already created this dataset repo", self.endpoint)
            return f"{self.endpoint}/datasets/{repo_id}"
        folder = self.root / repo_id
        folder.mkdir(parents=True)
        self.repos[repo_id] = Repo(folder, bool(private))
        self._write(repo_id, "initial commit", {".gitattributes": GITATTRIBUTES})
        return f"{self.endpoint}/datasets/{repo_id}"

    def repo_info(self, repo_id, *, repo_type=None, revision=None, **_):
        repo = self._repo(repo_id, revision)
        return DatasetInfo(id=repo_id, sha=repo.head, private=repo.private)

    def list_repo_tree(self, repo_id, path_in_repo=None, *, recursive=False, revision=None, repo_type=None, **_):
        repo = self._repo(repo_id, revision)
        base = repo.folder / (path_in_repo or "")
        entries = sorted(base.rglob("*") if recursive else base.iterdir())
        for path in entries:
            name = path.relative_to(repo.folder).as_posix()
            if path.is_dir():
                yield RepoFolder(path=name, oid=hashlib.sha1(name.encode()).hexdigest())
            else:
                yield self._repo_file(repo, name, path.read_bytes())

    def create_commit(self, repo_id, operations, *, commit_message, repo_type=None, revision=None,
                      parent_commit=None, **_):
        repo = self._repo(repo_id, revision)
        self.commit_calls += 1
        if self.before_commit is not None:
            self.before_commit()
        if self.commit_calls == self.fail_at_commit:
            raise ConnectionError("the push was killed during this commit")
        if parent_commit is not None and parent_commit != repo.head:
            raise _error(HfHubHTTPError, 412, "A commit has happened since. Please refresh and try again.",
                         self.endpoint)
        files = {}
        for operation in operations:
            assert isinstance(operation, CommitOperationAdd), operation
            files[operation.path_in_repo] = _content_of(operation)
        oid = self._write(repo_id, commit_message, files)
        return CommitInfo(commit_url=f"{self.endpoint}/datasets/{repo_id}/commit/{oid}",
                          commit_message=commit_message, commit_description="", oid=oid, _endpoint=self.endpoint)

    # -- the store ------------------------------------------------------------------------------
    def _repo(self, repo_id: str, revision: str | None) -> Repo:
        assert revision in (None, "main"), revision
        if repo_id not in self.repos:
            raise _error(RepositoryNotFoundError, 404, f"Repository Not Found for url: {repo_id}", self.endpoint)
        return self.repos[repo_id]

    def _is_lfs(self, repo: Repo, name: str) -> bool:
        attributes = (repo.folder / ".gitattributes").read_text().splitlines()
        return any(fnmatch.fnmatch(Path(name).name, line.split()[0]) for line in attributes if "filter=lfs" in line)

    def _repo_file(self, repo: Repo, name: str, content: bytes) -> RepoFile:
        if not self._is_lfs(repo, name):
            return RepoFile(path=name, size=len(content), oid=git_blob_id(content))
        sha256 = hashlib.sha256(content).hexdigest()
        pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {len(content)}\n".encode()
        return RepoFile(path=name, size=len(content), oid=git_blob_id(pointer),
                        lfs={"size": len(content), "oid": sha256, "pointerSize": len(pointer)})

    def _write(self, repo_id: str, message: str, files: dict[str, bytes]) -> str:
        """The files written (each to a temporary name, then renamed, as a commit is all or nothing to a reader) and
        the commit recorded; a commit that changes nothing is skipped, as the Hub skips an empty commit."""
        repo = self.repos[repo_id]
        changed = {name: content for name, content in files.items()
                   if not (repo.folder / name).is_file() or (repo.folder / name).read_bytes() != content}
        if not changed and repo.commits:
            return repo.head
        for name, content in changed.items():
            path = repo.folder / name
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.incoming")
            tmp.write_bytes(content)
            os.replace(tmp, path)
        parent = repo.commits[-1].oid if repo.commits else ""
        oid = hashlib.sha1(f"{parent}\n{message}\n{sorted(changed)}".encode()).hexdigest()
        repo.commits.append(Commit(oid, message, sorted(changed)))
        self._save(repo_id)
        return oid

    def _save(self, repo_id: str) -> None:
        repo = self.repos[repo_id]
        state = self.root / STATE / f"{repo_id}.json"
        state.parent.mkdir(parents=True, exist_ok=True)
        tmp = state.with_name(f".{state.name}.incoming")
        tmp.write_text(json.dumps({"private": repo.private, "commits": [vars(commit) for commit in repo.commits]}))
        os.replace(tmp, state)


def _content_of(operation: CommitOperationAdd) -> bytes:
    source = operation.path_or_fileobj
    if isinstance(source, (str, Path)):
        return Path(source).read_bytes()
    if isinstance(source, bytes):
        return source
    return source.read()
