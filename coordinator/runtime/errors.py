"""The error of a job that cannot train as given, and how a user's own code is named in it.

A :class:`JobError` is raised in the coordinator's process, before any worker trains
whenever the cause can be seen there (``coordinator/runtime/preflight.py``): a factory that
raises, cells that do not fit the data or each other, data whose inputs and targets differ
in length, a model cut into more stages than it has cells. Its message is one line naming
the factory, the cell or the option and the fix; ``cellmesh run`` prints it as is and exits
2 (``coordinator/commands/run.py``). It is a ``ValueError``, as the inconsistent jobs it
replaces were. A :class:`JobFailed` is a job that stopped while it trained: a worker failed,
refused or vanished (``coordinator/runtime/driver.py``).
"""

from __future__ import annotations

import traceback
from pathlib import Path

import torch

__all__ = ["JobError", "JobFailed", "first_line", "located"]

# frames in these directories are torch's or cellmesh's, not the user's code
_NOT_USER = (Path(torch.__file__).resolve().parent, Path(__file__).resolve().parents[2] / "coordinator",
             Path(__file__).resolve().parents[2] / "services", Path(__file__).resolve().parents[2] / "comm")


class JobError(ValueError):
    """The job as given cannot train; the message names the factory, cell or option and the fix."""


class JobFailed(RuntimeError):
    """The job stopped: a worker failed or vanished. The message names the worker, service and step."""

    def __init__(self, message: str, *, worker: str = "", service: str = "", step: int | None = None,
                 lost: bool = False) -> None:
        super().__init__(message)
        self.worker = worker
        self.service = service
        self.step = step
        self.lost = lost  # the worker died, froze or vanished (a replacement can take over); else it refused


def first_line(exc: BaseException) -> str:
    """``exc``'s message up to its first blank line, on one line (torch.fx appends pages of notes)."""
    text = str(exc).split("\n\n", 1)[0]
    return " ".join(text.split()) or type(exc).__name__


def located(exc: BaseException) -> str:
    """``Type: message (at file:line)``, at the innermost frame of the user's code (else the innermost)."""
    frames = traceback.extract_tb(exc.__traceback__)
    user = [f for f in frames if not any(Path(f.filename).resolve().is_relative_to(d) for d in _NOT_USER)]
    chosen = user or list(frames)
    where = f" (at {chosen[-1].filename}:{chosen[-1].lineno})" if chosen else ""
    return f"{type(exc).__name__}: {first_line(exc)}{where}"
