"""What a worker's runtime maps besides the plan's tensors, measured once in a fresh interpreter.

[Note: the runtime's bytes] A worker's peak since its assignment (``StepReply.peak_bytes``,
``comm/memcap.py``'s ``PeakProbe``) counts, besides the stage's tensors and the gradient path's
buffers, what its runtime maps on first use: the step thread's malloc arena and stack, autograd's
engine, the modules the optimizer imports on its first step (``torch._dynamo``), the transport's
I/O thread. None of it depends on the model, so it is measured once per coordinator process, the
way a worker meets it: a fresh interpreter loads what a worker loads before an assignment (the
compute service and its imports, cellmesh's malloc thresholds), starts a :class:`PeakProbe`, then
runs a tiny model's forward, backward and Adam step on a new thread next to a zmq context, and
prints the probe's peak. Measured here: 38 MiB (torch 2.x, glibc), against 36-43 MiB of the
workers' peaks no tensor accounts for.

The planner adds it to every stage's peak (``MemoryUse.runtime``); the profile carries it
(``Profile.runtime_bytes``). The interpreter starts when profiling starts and is read when it ends
(:class:`RuntimeProbe`), so the imports overlap the profile; a failure or a timeout is logged and
counts 0 (the prediction is then short by that much).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading

__all__ = ["RUNTIME_PROBE_TIMEOUT_S", "RuntimeProbe", "runtime_bytes", "start"]

log = logging.getLogger(__name__)

RUNTIME_PROBE_TIMEOUT_S = 120.0  # the interpreter's imports take 3-10 s on a loaded 2-core machine

_SCRIPT = """
import threading
import torch
import zmq
from comm.allocator import tune_malloc
tune_malloc()
import services.compute.service  # what a worker has loaded before its first assignment
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


def start() -> None:
    """Start the measurement unless it ran or runs already (:func:`runtime_bytes` reads it)."""
    global _running
    with _lock:
        if _measured is None and _running is None:
            _running = RuntimeProbe()


def runtime_bytes() -> int:
    """The runtime's bytes (see [Note: the runtime's bytes]), measured on the first call in this process."""
    global _measured, _running
    start()
    with _lock:
        if _measured is None:
            assert _running is not None
            _measured, _running = _running.result(), None
        return _measured
