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
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading

__all__ = ["ENV", "RUNTIME_PROBE_TIMEOUT_S", "RuntimeProbe", "runtime_bytes", "start"]

log = logging.getLogger(__name__)

ENV = "CELLMESH_RUNTIME_BYTES"  # set: the runtime's bytes as given, nothing measured
RUNTIME_PROBE_TIMEOUT_S = 120.0  # the interpreter's imports take 3-10 s on a loaded 2-core machine

_SCRIPT = """
import threading
import torch
import zmq
from comm.allocator import tune_malloc
tune_malloc()
import services.compute.service  # what a worker has loaded before its first assignment
from services.host.worker import RUNTIME_MODULES
for module in RUNTIME_MODULES:
    __import__(module)
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


def start() -> None:
    """Start the measurement unless it ran or runs already, or ``$CELLMESH_RUNTIME_BYTES`` gives it."""
    global _running
    with _lock:
        if _measured is None and _running is None and _given() is None:
            _running = RuntimeProbe()


def runtime_bytes() -> int:
    """The runtime's bytes (see [Note: the runtime's bytes]): ``$CELLMESH_RUNTIME_BYTES`` when set, else
    measured on the first call in this process."""
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
        return _measured
