"""What a worker's runtime maps besides the plan's tensors, measured once in a fresh interpreter.

[Note: the runtime's bytes] A worker's peak since its assignment (``StepReply.peak_bytes``,
``comm/memcap.py``'s ``PeakProbe``) counts, besides the stage's tensors and the gradient path's
buffers, what its runtime maps on first use: the step thread's malloc arena and stack, autograd's
engine, the transport's I/O thread. None of it depends on the model, so it is measured once per
coordinator process, the way a worker meets it: a fresh interpreter loads what a worker loads before
an assignment (the compute service and its imports, the modules every worker loads at start,
``services.host.worker.RUNTIME_MODULES``, cellmesh's malloc thresholds), starts a
:class:`PeakProbe`, then runs a tiny model's forward, backward and Adam step on a new thread next to
a zmq context, and prints the probe's peak. Measured here: 11 MiB (torch 2.13, glibc). It was 38 MiB
while workers imported ``torch._dynamo`` (any optimizer's constructor needs it) at their first
assignment, inside the peak; they load it at start now.

The planner adds it to every stage's peak (``MemoryUse.runtime``); the profile carries it
(``Profile.runtime_bytes``). The interpreter starts when profiling starts and is read when it ends
(:class:`RuntimeProbe`), so the imports overlap the profile; a failure or a timeout is logged and
counts 0 (the prediction is then short by that much).

``CELLMESH_RUNTIME_BYTES`` (a byte count) skips the measurement: for a coordinator whose interpreter
is not the workers' (another image, GPU workers whose runtime is counted by the device), or one that
plans many jobs on one machine and has measured it once.

[Note: the runtime's bytes, kept] The measuring interpreter costs every ``cellmesh run`` and
``cellmesh plan`` its imports: 3-10 s of a 2-core machine's CPU beside the profile, and on a loaded
one the command waited 5.4 s for it after the profile had ended. Its answer changes only with the
interpreter, the libraries and cellmesh's own code, so a successful measurement is kept in a file of
the user's cache (``$CELLMESH_CACHE_DIR``, else ``$XDG_CACHE_HOME/cellmesh``, else
``~/.cache/cellmesh``; ``CELLMESH_CACHE_DIR=off`` keeps nothing), named by a fingerprint of all of
them (:func:`fingerprint`: the interpreter's path and version, the versions of torch, pyzmq and
numpy, the C library, this probe's script, and the bytes of every module under ``comm/`` and
``services/``, the code a worker runs). Any change measures again; a failed measurement (0) is never
kept; a cache that cannot be read or written (a read-only home in a pod) is skipped with a debug
line, never an error. Deleting the file measures again; the cache keeps the 16 newest measurements.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

__all__ = ["CACHE_ENV", "ENV", "RUNTIME_PROBE_TIMEOUT_S", "RuntimeProbe", "cache_dir", "fingerprint",
           "runtime_bytes", "start"]

log = logging.getLogger(__name__)

ENV = "CELLMESH_RUNTIME_BYTES"  # set: the runtime's bytes as given, nothing measured
CACHE_ENV = "CELLMESH_CACHE_DIR"  # where measurements are kept ("off": nowhere); see [Note: ..., kept]
_ROOT = Path(__file__).resolve().parents[2]  # the tree holding comm/ and services/
_WORKER_CODE = ("comm", "services")  # what a worker runs: its bytes are part of the fingerprint
KEPT = 16  # measurements kept in the cache, the newest
RUNTIME_PROBE_TIMEOUT_S = 120.0  # the interpreter's imports take 3-10 s on a loaded 2-core machine

_SCRIPT = """
import threading
import torch
import zmq
from comm.allocator import tune_malloc
tune_malloc()
import services.compute.service  # what a worker has loaded before its first assignment
from services.host.worker import RUNTIME_MODULES
from comm.heap import settle_imports
for module in RUNTIME_MODULES:
    __import__(module)
settle_imports()
from comm.memcap import PeakProbe
probe = PeakProbe().start()
context = zmq.Context()
a, b = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
a.bind("inproc://runtime"); b.connect("inproc://runtime"); b.send(b"x"); a.recv()
def step():
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
thread = threading.Thread(target=step)
thread.start()
thread.join()
print(probe.peak())
"""

_lock = threading.Lock()
_measured: int | None = None
_running: RuntimeProbe | None = None


class RuntimeProbe:
    """The measuring interpreter, started at construction; :meth:`result` waits for its answer."""

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "OMP_NUM_THREADS": "1"}
        self._proc: subprocess.Popen[str] | None = None
        try:
            self._proc = subprocess.Popen([sys.executable, "-c", _SCRIPT], stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, env=env)
        except OSError as exc:
            log.warning("measuring the worker runtime's bytes: cannot start %s: %s; counting 0",
                        sys.executable, exc)

    def result(self, timeout_s: float = RUNTIME_PROBE_TIMEOUT_S) -> int:
        """The measured bytes (0, logged, if the interpreter failed or did not answer in ``timeout_s``)."""
        if self._proc is None:
            return 0
        try:
            out, err = self._proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.communicate()
            log.warning("measuring the worker runtime's bytes: no answer within %.0f s; counting 0 (the "
                        "planner's memory predictions are short by it)", timeout_s)
            return 0
        lines = out.split()
        if self._proc.returncode != 0 or not lines or not lines[-1].isdigit():
            log.warning("measuring the worker runtime's bytes failed (exit %s): %s; counting 0",
                        self._proc.returncode, err.strip()[-300:])
            return 0
        return int(lines[-1])


def _given() -> int | None:
    """``$CELLMESH_RUNTIME_BYTES`` as a byte count, None when unset; a clear error when it is not one."""
    text = os.environ.get(ENV, "").strip()
    if not text:
        return None
    if not text.isdigit():
        raise ValueError(f"${ENV}={text!r} is not a byte count: set a whole number of bytes (the worker "
                         f"runtime's bytes, e.g. 40000000), or unset it to have them measured")
    return int(text)


def cache_dir() -> Path | None:
    """Where measurements are kept (see [Note: the runtime's bytes, kept]); None: nowhere."""
    given = os.environ.get(CACHE_ENV, "").strip()
    if given.lower() == "off":
        return None
    if given:
        return Path(given)
    base = os.environ.get("XDG_CACHE_HOME", "").strip()
    if base:
        return Path(base) / "cellmesh"
    try:
        return Path.home() / ".cache" / "cellmesh"
    except RuntimeError:  # no home directory to be found
        return None


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def fingerprint() -> str:
    """What the measurement depends on, hashed: the interpreter, the libraries, the probe's script and the
    workers' code (see [Note: the runtime's bytes, kept])."""
    digest = hashlib.sha256()
    for part in (sys.executable, sys.version, *map(_version, ("torch", "pyzmq", "numpy")),
                 " ".join(platform.libc_ver()), _SCRIPT):
        digest.update(part.encode() + b"\0")
    for top in _WORKER_CODE:
        for path in sorted((_ROOT / top).rglob("*.py")):
            digest.update(str(path.relative_to(_ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:32]


_key: str | None = None


def _cache_file() -> Path | None:
    global _key
    where = cache_dir()
    if where is None:
        return None
    if _key is None:
        try:
            _key = fingerprint()
        except OSError as exc:  # a module that cannot be read: nothing kept
            log.debug("the runtime's bytes: no fingerprint (%s); nothing kept", exc)
            return None
    return where / f"runtime-bytes-{_key}.json"


def _kept() -> int | None:
    """The kept measurement for this fingerprint, or None."""
    path = _cache_file()
    if path is None:
        return None
    try:
        value = json.loads(path.read_text())["bytes"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return value if type(value) is int and value > 0 else None  # not a bool, not a float


def _keep(value: int) -> None:
    """Keep a successful measurement (best effort: a cache that cannot be written is skipped)."""
    path = _cache_file()
    if path is None or value <= 0:
        return
    record = {"bytes": value, "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "python": sys.executable, "torch": _version("torch")}
    written: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=".runtime-bytes-", delete=False) as out:
            written = out.name
            json.dump(record, out)
        os.replace(written, path)  # whole or not at all: another process may read it meanwhile
        _prune(path.parent)
    except OSError as exc:
        log.debug("the runtime's bytes: not kept in %s: %s", path.parent, exc)
        if written is not None:
            with contextlib.suppress(OSError):
                os.unlink(written)


def _prune(where: Path) -> None:
    """Keep the :data:`KEPT` newest measurements (each venv and each version of the code leaves its own)."""
    def age(path: Path) -> float:
        try:
            return path.stat().st_mtime
        except OSError:  # another process pruned it meanwhile
            return 0.0
    for old in sorted(where.glob("runtime-bytes-*.json"), key=age, reverse=True)[KEPT:]:
        with contextlib.suppress(OSError):
            old.unlink()


def start() -> None:
    """Start the measurement unless it ran or runs already, ``$CELLMESH_RUNTIME_BYTES`` gives it, or it is
    kept (see [Note: the runtime's bytes, kept])."""
    global _running, _measured
    with _lock:
        if _measured is None and _running is None and _given() is None:
            kept = _kept()
            if kept is not None:
                _measured = kept
            else:
                _running = RuntimeProbe()


def runtime_bytes() -> int:
    """The runtime's bytes (see [Note: the runtime's bytes]): ``$CELLMESH_RUNTIME_BYTES`` when set, else
    kept from an earlier measurement of the same fingerprint, else measured on the first call in this
    process (and kept)."""
    global _measured, _running
    given = _given()
    if given is not None:
        return given
    start()
    with _lock:
        if _measured is None:
            if _running is None:  # the variable was unset between start() and here
                _running = RuntimeProbe()
            _measured, _running = _running.result(), None
            _keep(_measured)
        return _measured
