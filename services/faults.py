"""The fault-injection hook: kill or freeze this worker process at a chosen (step, phase).

Production code calls :func:`at` at each phase of a step; it does nothing (one global read)
unless the process was started with ``CELLMESH_FAULT=STEP:PHASE[:ACTION]``, which tests and
drills set on one worker (``LocalHarness(..., worker_env={name: {...}})``). A replacement
process is started without it, so a replayed step does not fail again.

* ``STEP``: the ``RunStep.step`` being served (from 0); for ``save``, the step whose
  commit took the snapshot being written.
* ``PHASE``: ``step`` (as the request arrives), ``forward`` (first forward), ``backward``
  (first backward), ``sync`` (the gradient all-reduce), ``optimizer`` or ``push_pull``
  (applying the previous step's update at the start of the step), ``save`` (writing a
  checkpoint part, in the background);
* ``ACTION``: ``kill`` (the default: SIGKILL, like a crash or an OOM kill), ``stop``
  (SIGSTOP: a frozen process that holds its sockets) or ``delay`` / ``delay=SECONDS`` (sleep
  there, 3 s by default, then go on: slow storage for ``save``, a straggler for a step phase).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Final, Literal

__all__ = ["ENV", "PHASES", "FaultSpec", "at", "parse"]

log = logging.getLogger(__name__)

ENV: Final = "CELLMESH_FAULT"
Phase = Literal["step", "forward", "backward", "sync", "optimizer", "push_pull", "save"]
PHASES: Final = ("step", "forward", "backward", "sync", "optimizer", "push_pull", "save")
ACTIONS: Final = ("kill", "stop", "delay")
DELAY_S: Final = 3.0  # how long ``delay`` sleeps when it names no time


class FaultSpec:
    """Where to fail: ``step``, ``phase``, ``action``."""

    def __init__(self, step: int, phase: str, action: str, seconds: float = DELAY_S) -> None:
        self.step, self.phase, self.action, self.seconds = step, phase, action, seconds

    def __repr__(self) -> str:
        delay = f"={self.seconds:g}" if self.action == "delay" else ""
        return f"{self.step}:{self.phase}:{self.action}{delay}"


def parse(text: str) -> FaultSpec:
    """``"3:backward"``, ``"3:backward:stop"`` or ``"6:save:delay=2"`` as a :class:`FaultSpec`.

    Raises:
        ValueError: Naming the part that is wrong and the accepted values.
    """
    parts = text.strip().split(":")
    if len(parts) not in (2, 3) or not parts[0].isdigit():
        raise ValueError(f"{ENV}={text!r}: expected STEP:PHASE[:ACTION], e.g. 3:backward or 3:backward:stop")
    action, _, seconds = (parts[2] if len(parts) == 3 else "kill").partition("=")
    if parts[1] not in PHASES:
        raise ValueError(f"{ENV}={text!r}: phase {parts[1]!r} is not one of {', '.join(PHASES)}")
    if action not in ACTIONS or (seconds and action != "delay"):
        raise ValueError(f"{ENV}={text!r}: action {parts[2]!r} is not one of {', '.join(ACTIONS)} "
                         "(or delay=SECONDS)")
    try:
        delay = float(seconds) if seconds else DELAY_S
    except ValueError:
        raise ValueError(f"{ENV}={text!r}: delay={seconds!r} is not a number of seconds") from None
    return FaultSpec(int(parts[0]), parts[1], action, delay)


_spec: FaultSpec | None = parse(os.environ[ENV]) if os.environ.get(ENV) else None


def at(step: int, phase: Phase) -> None:
    """Fail here if this process was told to fail at (``step``, ``phase``); else return at once."""
    spec = _spec
    if spec is None or spec.step != step or spec.phase != phase:
        return
    log.warning("fault injection (%s=%r): %s now, at step %d, phase %s", ENV, spec, spec.action, step, phase)
    if spec.action == "delay":
        time.sleep(spec.seconds)
        return
    for handler in logging.getLogger().handlers:
        handler.flush()
    os.kill(os.getpid(), signal.SIGKILL if spec.action == "kill" else signal.SIGSTOP)
