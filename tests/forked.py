"""The job's commands (`python jobs/<job>.py ...`) as processes forked from a server that has imported torch and
transformers once (a zygote).

A fresh `python jobs/embed.py` spends about 5 s of CPU importing torch, transformers and a family's modeling module
before its first record; the suite starts the job as a process some forty times, for what only a process proves: its
exit code and its one-line errors, SIGTERM and SIGKILL at any moment, two jobs on one run directory at once. Here
each such process is forked from multiprocessing's forkserver, which has imported those libraries (never batchvlm,
whose modules read the environment a test gives the job) and has run no torch op, so no thread of theirs is lost in
the fork. The child then becomes the command: its own environment, working folder, session, standard streams,
`sys.argv` and `sys.path` as a fresh interpreter would have them, `__main__` run by runpy, the exit functions run at
the end; it is the job's own process (signals, `os._exit`, its decoder and worker children), its exit code is the
command's. What a fresh interpreter alone proves (the installed job and its entry points, imports without torch, a
stderr with nothing a dependency prints on import, peak memory, `accelerate launch` and `torchrun`) still starts one.

Not carried into the child: what the libraries above read from the environment as they are imported (the zygote's
environment is the test process's at its first use: OMP_NUM_THREADS, HF_HUB_OFFLINE, ...), which the tests never set
per command.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import io
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import weakref
from pathlib import Path

PRELOAD = ["torch", "transformers", "transformers.modeling_utils", "accelerate", "hydra", "omegaconf", "PIL.Image",
           "transformers.models.kimi_k25.modeling_kimi_k25", "transformers.models.qwen2_vl.modeling_qwen2_vl",
           "transformers.models.qwen3_vl.modeling_qwen3_vl", "transformers.models.siglip2.modeling_siglip2"]
"""What every job imports and takes seconds to: not pyarrow (its import starts a thread), not batchvlm."""


@functools.cache
def _server():
    """multiprocessing's forkserver, which imports PRELOAD as it starts (once a test process, on first use)."""
    server = multiprocessing.get_context("forkserver")
    server.set_forkserver_preload(PRELOAD)
    return server


@functools.cache
def _fresh_path() -> tuple[str, ...]:
    """sys.path past its first entry as a fresh interpreter has it with no PYTHONPATH: asked of one, once."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    probe = subprocess.run([sys.executable, "-c", "import sys; print('\\n'.join(sys.path[1:]))"], env=env,
                           capture_output=True, text=True, check=True)
    return tuple(probe.stdout.splitlines())


def _become(argv: list[str], cwd: str, env: dict[str, str], fresh_path: tuple[str, ...],
            streams: tuple[str, str], new_session: bool, ready) -> None:
    """In the forked child: `python script args...` as a fresh interpreter runs it."""
    if new_session:
        os.setsid()
    for fd, path, mode in ((0, os.devnull, os.O_RDONLY), (1, streams[0], os.O_WRONLY | os.O_APPEND),
                           (2, streams[1], os.O_WRONLY | os.O_APPEND)):
        opened = os.open(path, mode)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdout = io.TextIOWrapper(open(1, "wb", closefd=False))
    sys.stderr = io.TextIOWrapper(open(2, "wb", closefd=False), errors="backslashreplace", line_buffering=True)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    multiprocessing.set_start_method(None, force=True)  # the platform's default, as in a fresh interpreter
    signal.signal(signal.SIGINT, signal.default_int_handler)
    ready.send(os.getpid())
    ready.close()
    script = os.path.abspath(argv[1])
    python_path = [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry]
    sys.path[:] = [os.path.dirname(os.path.realpath(script)), *python_path, *fresh_path]
    sys.argv = argv[1:]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()


_LIVE: weakref.WeakSet = weakref.WeakSet()
"""The commands started and not known to have ended."""


@atexit.register
def _kill_the_live() -> None:
    """A command a test left running, killed as the test process ends: registered after multiprocessing's exit
    function, this runs before that one joins its children (which would wait for the command)."""
    for job in list(_LIVE):
        job.kill()


class ForkedProcess:
    """A running command, as much of subprocess.Popen as the tests use: pid, poll, wait, returncode, kill, terminate,
    send_signal; stdout and stderr, where asked for (subprocess.PIPE), are files the child writes and the test reads
    (a pipe's buffer could fill before the test reads it)."""

    def __init__(self, args: list[str], *, cwd: Path | str | None = None, env: dict[str, str] | None = None,
                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text: bool = True, start_new_session: bool = False):
        if len(args) < 2 or args[0] != sys.executable or args[1].startswith("-"):
            raise ValueError(f"not `python script ...`: {args}")
        self.args, self.returncode = args, None
        self._files = []
        streams = tuple(self._stream(choice, text) for choice in (stdout, stderr))
        self.stdout, self.stderr = (reader for _, reader in streams)
        reader, writer = _server().Pipe(duplex=False)
        self._process = _server().Process(
            target=_become, daemon=False,
            args=(args, str(cwd or os.getcwd()), dict(os.environ if env is None else env), _fresh_path(),
                  tuple(path for path, _ in streams), start_new_session, writer))
        self._process.start()
        _LIVE.add(self)
        writer.close()
        try:  # after setsid: a killpg of the pid reaches the job's whole group
            self.pid = reader.recv()
        except EOFError:
            self.pid = self._process.pid
        reader.close()
        for name in self._files:  # the child has them open: gone with the last handle
            os.unlink(name)

    def _stream(self, choice, text: bool):
        if choice == subprocess.PIPE:
            handle = tempfile.NamedTemporaryFile("w+" if text else "w+b", prefix="forked-", delete=False)
            self._files.append(handle.name)
            return handle.name, handle
        if choice == subprocess.DEVNULL:
            return os.devnull, None
        # None would be the zygote's streams, inherited as the test that started it had them
        raise ValueError(f"stdout and stderr are subprocess.PIPE or subprocess.DEVNULL here, not {choice!r}")

    def poll(self) -> int | None:
        if self.returncode is None and self._process.exitcode is not None:
            self.returncode = self._process.exitcode
            _LIVE.discard(self)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple:
        """Popen.communicate with no input: the command's end (killed past `timeout`, as subprocess.run does), and
        what it wrote to the streams asked for."""
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self.wait()
            raise
        return tuple(None if stream is None else stream.read() for stream in (self.stdout, self.stderr))

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it ended after the poll, as Popen allows
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def run(args: list[str], *, cwd: Path | str | None = None, env: dict[str, str] | None = None,
        timeout: float = 600) -> subprocess.CompletedProcess:
    """subprocess.run(args, capture_output=True, text=True, timeout=timeout) for a Python command, forked."""
    job = ForkedProcess(args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    stdout, stderr = job.communicate(timeout)
    return subprocess.CompletedProcess(args, job.returncode, stdout, stderr)
