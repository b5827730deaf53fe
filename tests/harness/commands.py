"""The tests' Python commands (``cellmesh ...``, ``python -m ...``), forked from the harness's fork server.

Usage::

    done = commands.run(["cellmesh", "run", "job.yaml"], cwd=ROOT, env=env, timeout=60)
    # done: a subprocess.CompletedProcess[str] (returncode, stdout, stderr), as subprocess.run's
    worker = commands.start([sys.executable, "-m", "services.host.worker", ...], env=env)
    # worker: Popen's pid, poll, wait, send_signal, terminate, kill and returncode

[Note: commands from a fork server]
Each ``cellmesh`` command and each worker a test starts is its own process, as a user's would be, but a
fresh interpreter spends 3 s of CPU importing torch, and 2.4 s more on ``torch._dynamo`` once it makes an
optimizer (every ``cellmesh run`` checks its optimizer); the suite starts dozens. So a command is forked
from the multiprocessing fork server the rank harness already keeps (:mod:`tests.harness.procs`: the
third-party libraries imported once, no cellmesh module, no thread), and in the fork it becomes what a
fresh ``python`` would have been for it:

* its environment is the one given (a fresh interpreter's ``PYTHONPATH`` entries go on ``sys.path``), its
  working directory the one given and first on ``sys.path`` as ``-m`` puts it;
* its stdout and stderr are files (read back as ``capture_output`` would give them) or ``/dev/null``, or
  stay the test process's stderr; stdin is ``/dev/null``;
* ``argv`` is ``[python, -m, module, *args]`` (run as ``__main__`` by :mod:`runpy`) or a console script of
  this environment (``.../bin/cellmesh``; its entry point is called with ``sys.argv`` as the script's);
* it exits as the interpreter would: the code of ``SystemExit``, 1 with the traceback on stderr for any
  other exception, after its non-daemon threads and its own ``atexit`` functions (not the fork server's).

A ``cellmesh`` command's own fork server (``coordinator/runtime/forkserver.py``, for the workers of a
local run) is forked from the command at its start (``forkserver.fork_here``): it holds what a fresh server
would import, so each run spares its import (5 s of CPU).

What the fork cannot give is a fresh interpreter's start: its signal dispositions and thread count are the
fork server's (SIGINT as the test process had it; torch's threads set from ``OMP_NUM_THREADS``). A test
about interpreter start-up itself, or one that needs a process group of its own, uses ``subprocess``.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import subprocess
import sys
import tempfile
import threading
import traceback
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgpack

__all__ = ["DEVNULL", "STDOUT", "Started", "run", "start", "stop_all"]

DEVNULL = subprocess.DEVNULL
STDOUT = subprocess.STDOUT
_live: weakref.WeakSet[Started] = weakref.WeakSet()


class Started:
    """A command started by :func:`start`: the part of :class:`subprocess.Popen` the tests use."""

    def __init__(self, proc: Any, argv: Sequence[str]) -> None:
        self._proc = proc
        self.args = list(argv)
        self.pid: int = proc.pid

    @property
    def returncode(self) -> int | None:
        code: int | None = self._proc.exitcode
        return code

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit code, waiting up to ``timeout`` seconds (``subprocess.TimeoutExpired`` past it)."""
        self._proc.join(timeout)
        code = self.returncode
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self._proc.terminate()

    def kill(self) -> None:
        self._proc.kill()

    def stop(self) -> None:
        """Kill it if it still runs and reap it (what every test's cleanup does)."""
        if self.returncode is None:
            with contextlib.suppress(Exception):
                self._proc.kill()
        self._proc.join(5)


def start(argv: Sequence[str | os.PathLike[str]], *, env: Mapping[str, str] | None = None,
          cwd: str | os.PathLike[str] | None = None, stdout: Path | int | None = None,
          stderr: Path | int | None = None, append: bool = False, new_session: bool = False) -> Started:
    """Start ``argv`` forked from the fork server ([Note: commands from a fork server]).

    ``env``: its whole environment (default: this process's). ``stdout``/``stderr``: a file path (written
    afresh, or appended to with ``append``), :data:`DEVNULL`, or None for this process's stderr (both);
    ``stderr`` may also be :data:`STDOUT`. ``new_session``: in a session (and process group) of its own,
    as ``Popen(start_new_session=True)``.
    """
    from tests.harness.procs import _context

    args = [os.fspath(a) for a in argv]
    config = msgpack.packb({
        "argv": args,
        "env": dict(os.environ if env is None else env),
        "cwd": os.fspath(cwd) if cwd is not None else os.getcwd(),
        "stdout": _target(stdout), "stderr": "=stdout" if stderr == STDOUT else _target(stderr),
        "append": append, "new_session": new_session,
    })
    proc = _context().Process(target=_child_main, args=(config,), name=f"command-{Path(args[0]).name}",
                              daemon=False)
    proc.start()
    started = Started(proc, args)
    _live.add(started)
    return started


def run(argv: Sequence[str | os.PathLike[str]], *, env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` to its end with its output captured, as ``subprocess.run(capture_output=True,
    text=True)`` would; killed and ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""
    with tempfile.TemporaryDirectory(prefix="cellmesh-command-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        started = start(argv, env=env, cwd=cwd, stdout=out, stderr=err)
        try:
            code = started.wait(timeout)
        except subprocess.TimeoutExpired as exc:
            started.stop()
            exc.output, exc.stderr = _read(out), _read(err)
            raise
        return subprocess.CompletedProcess(started.args, code, _read(out), _read(err))


def stop_all() -> None:
    """Kill every command still running (the session's end)."""
    for started in list(_live):
        started.stop()


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _target(where: Path | int | None) -> str | None:
    if where is None:
        return None
    if where == DEVNULL:
        return os.devnull
    if isinstance(where, int):
        raise ValueError(f"stdout/stderr: a path, DEVNULL or None, not the descriptor {where}")
    return os.fspath(where)


# -- the child ----------------------------------------------------------------------------------


def _child_main(config_bytes: bytes) -> None:
    config = msgpack.unpackb(config_bytes)
    if config["new_session"]:
        os.setsid()
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if config["append"] else os.O_TRUNC)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        if config[name] == "=stdout":
            os.dup2(1, 2)
        elif config[name] is not None:
            target = os.open(config[name], flags, 0o644)
            os.dup2(target, fd)
            os.close(target)
    os.environ.clear()
    os.environ.update(config["env"])
    os.chdir(config["cwd"])
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:0] = [config["cwd"], *extra]
    atexit._clear()  # the fork server's own exit functions are not this command's
    code: Any = 0
    try:
        import torch

        torch.set_num_threads(_threads())
        _fork_server_here(list(config["argv"]))
        _run_argv(list(config["argv"]))
    except SystemExit as exc:
        code = exc.code
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        _exit_like_an_interpreter()
    raise SystemExit(code)


def _threads() -> int:
    """Torch's intra-op threads in a fresh interpreter here: ``OMP_NUM_THREADS``, else one a core."""
    with contextlib.suppress(ValueError):
        return max(1, int(os.environ.get("OMP_NUM_THREADS", "")))
    return len(os.sched_getaffinity(0))


def _fork_server_here(argv: list[str]) -> None:
    """A ``cellmesh`` command's fork server for its workers, forked from this process now (still one thread,
    nothing of cellmesh loaded, the libraries the server would import loaded: ``forkserver.fork_here``)
    instead of a fresh interpreter importing them again (5 s of CPU a run), unless the command's
    environment turns the server off."""
    if Path(argv[0]).name == "cellmesh" or argv[1:3] == ["-m", "cellmesh"]:
        from coordinator.runtime import forkserver

        if forkserver.enabled():
            with contextlib.suppress(OSError):  # no fork now (EAGAIN): the command starts its server itself
                forkserver.fork_here()


def _run_argv(argv: list[str]) -> None:
    import runpy

    if len(argv) >= 3 and argv[1] == "-m":
        sys.argv = [argv[0], *argv[3:]]
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
        return
    from importlib.metadata import entry_points

    script = Path(argv[0]).name
    found = entry_points(group="console_scripts", name=script)
    if not found:
        raise ValueError(f"{argv[0]!r}: neither 'python -m module' nor a console script of this environment")
    main = next(iter(found)).load()
    sys.argv = list(argv)
    sys.exit(main())


def _exit_like_an_interpreter() -> None:
    """What the interpreter does at its end: wait for non-daemon threads, run ``atexit``, flush."""
    current = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not current and not thread.daemon:
            thread.join()
    with contextlib.suppress(Exception):
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
