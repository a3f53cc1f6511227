"""Real child processes without paying for a new Python each time.

A new interpreter spends about 2 s of CPU importing torch and bigbatch before it does anything,
and most of this suite's time went there: gloo ranks, runs to kill or signal, children under a
resource limit. ``multiprocessing``'s forkserver imports them once per test worker (``PRELOAD``)
and forks every child from that clean, single-threaded parent. A child is still a real process:
its own pid, memory and resource limits; signals, SIGSTOP and SIGKILL reach it alone; its exit
status comes back. Only the start-up is skipped.

``context()`` is the multiprocessing context (``ctx.Process``, ``ctx.Queue``); ``python(...)``
runs ``python -m module args`` or ``python script args`` in such a child, with its own
environment, working directory and output files, and exits as the interpreter would.
"""

from __future__ import annotations

import atexit
import importlib.util
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import pytest

# Imported once by the fork server; a module that is missing (an extra not installed) is skipped.
# torch._dynamo too: torch.optim.Optimizer's constructor imports it (1.3 s of CPU in every child
# that builds an optimizer, nearly all of them).
PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "bigbatch", "bigbatch.app.cli",
           "bigbatch.app.loop", "torch.utils.tensorboard"]  # fmt: skip


def context() -> multiprocessing.context.BaseContext:
    """The forkserver context, its server importing ``PRELOAD`` when it starts."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


class Child:
    """A ``subprocess.Popen``-like handle on a forked child: ``pid``, ``wait``, ``returncode``,
    ``kill``, ``poll``."""

    def __init__(self, process: multiprocessing.process.BaseProcess) -> None:
        self.process, self.pid = process, process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(f"child {self.pid}", timeout or 0)
        return self.process.exitcode

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)


def stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP): its state in ``/proc`` (a forked child is not
    ours to ``waitpid``: the fork server is its parent)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] in ("T", "t")


def python(
    args: list[str], env: dict[str, str] | None = None, cwd: str | None = None,
    stdout: str | None = None, stderr: str | None = None, fresh: bool = False,
) -> Child | subprocess.Popen:  # fmt: skip
    """Start ``python ARGS`` (``["-m", "bigbatch", ...]`` or ``["script.py", ...]``, with or without
    ``sys.executable`` first) in a forked child; its stdout and stderr go to the files named (else
    to /dev/null). ``fresh``: in a new interpreter instead, for what depends on the process's
    history (CPU peak readings: a forked child faults in the library pages it runs, which a fresh
    process touched on import)."""
    if args and args[0] == sys.executable:
        args = args[1:]
    if ["-m", "bigbatch"] in (args[i : i + 2] for i in range(len(args))):
        needs_the_command_line()
    if fresh:
        with open(stdout or os.devnull, "w") as out, open(stderr or os.devnull, "w") as err:
            return subprocess.Popen(
                [sys.executable, *args], env=env, cwd=cwd, stdout=out, stderr=err
            )
    process = context().Process(target=_interpreter, args=(args, env, cwd, stdout, stderr))
    process.start()
    return Child(process)


def needs_the_command_line() -> None:
    """Skip the test where ``bigbatch``'s command line cannot run: without its extra it prints one
    line saying what to install (tested in test_cli.py) and trains nothing."""
    if importlib.util.find_spec("rich") is None:
        pytest.skip("needs rich: pip install -e '.[cli]'")


def run(args: list[str], env: dict[str, str] | None = None, timeout: float = 300, **kw):
    """``python(args)`` to its end: ``(returncode, stdout, stderr)`` as text."""
    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        child = python(args, env, stdout=out, stderr=err, **kw)
        try:
            code = child.wait(timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(10)
            raise subprocess.TimeoutExpired(args, timeout) from None
        return subprocess.CompletedProcess(args, code, Path(out).read_text(), Path(err).read_text())


def _interpreter(args, env, cwd, stdout, stderr) -> None:
    """In the child: what ``python ARGS`` does after start-up, then exit as it would."""
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
        sys.path[:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    for fd, name in ((1, stdout), (2, stderr)):
        target = os.open(name or os.devnull, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    if cwd is not None:
        os.chdir(cwd)
    code = 0
    try:
        if args[0] == "-m":
            sys.argv = [args[1], *args[2:]]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(args)
            sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        _leave()
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # as CPython: die of SIGINT
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
    except BaseException:
        traceback.print_exc()
        code = 1
    _leave()
    os._exit(code)


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _leave() -> None:
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
