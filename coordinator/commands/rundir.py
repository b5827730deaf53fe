"""The run directory: everything one run of a job leaves behind, in one place a user can find.

``cellmesh run`` and ``cellmesh coordinator`` create ``out/<job>-<YYYYmmdd-HHMMSS>/`` (with
``-2``, ``-3``... appended when that name is taken, so two runs in the same second get two
directories) or use the job config's ``logging.run_dir`` (``--run-dir DIR``) as given. It holds::

    plan.json          the chosen plan (Plan.to_json; Plan.from_json reads it back)
    plan.txt           the plan as printed
    run.json           the run record (a RunRecord: job, phase, steps, loss, evaluations, bubbles, error...)
    coordinator.log    the coordinator process's log records
    workers/NAME.log   each local worker process's stdout and stderr
    trace.json         measured and predicted steps as a Chrome trace (coordinator/runtime/trace.py)
    checkpoints/       the run's checkpoints (step-*/, coordinator/runtime/checkpoints.py)
    model.pt           the final state_dict

Every file is written atomically (a temporary file, then a rename), so a reader never sees
half of one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Literal

from pydantic import Field

from comm.codec import Message

__all__ = ["DEFAULT_ROOT", "MAX_BUBBLES", "BubbleEntry", "EvalEntry", "Phase", "RunDir", "RunRecord",
           "previous_checkpoint_roots", "write_atomic"]

DEFAULT_ROOT = Path("out")
MAX_SUFFIX = 1000  # runs of one job started in the same second
MAX_BUBBLES = 1024  # the record keeps the bubbles of this many latest steps (it is also a status reply)

Phase = Literal["starting", "waiting", "training", "done", "failed"]


class EvalEntry(Message):
    """One evaluation on the held-out data: after ``step`` steps, mean loss and metric over its samples."""

    step: int = Field(ge=0)
    loss: float
    metric: float | None = None
    num_samples: int = Field(ge=0)


class BubbleEntry(Message):
    """One step's pipeline bubble: measured from its actions' times (``coordinator/runtime/bubble.py``; None
    when the step timed no actions) and predicted by the simulator for the plan."""

    step: int = Field(ge=0)
    measured: float | None = None
    predicted: float | None = None


class RunRecord(Message):
    """Where a run is: ``run.json`` of its run directory, and the coordinator's ``status`` reply."""

    job: str
    phase: Phase
    run_dir: str = ""
    workers: list[str] = Field(default_factory=list)
    step: int = Field(default=0, ge=0)  # steps finished, counted from the job's start (a resumed run too)
    steps: int = Field(default=0, ge=0)  # steps to train
    loss: float | None = None  # the last finished step's
    samples_per_s: float | None = None
    output: str = ""  # the final state_dict
    error: str = ""
    spec_sha256: str = ""  # of the job file: a record of another spec under the same name is not this job's
    checkpoint: str = ""  # the newest checkpoint published
    resumed_from: str = ""  # the checkpoint the run started from
    # each failure the run survived, in one line: when, which worker, why, what was done, from which step
    recoveries: list[str] = Field(default_factory=list, max_length=1 << 12)
    evals: list[EvalEntry] = Field(default_factory=list, max_length=1 << 16)  # each evaluation, in step order
    # the last MAX_BUBBLES steps' measured and predicted bubble fractions, in step order
    bubbles: list[BubbleEntry] = Field(default_factory=list, max_length=MAX_BUBBLES)


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        if isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            tmp.write_text(data, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@dataclass(frozen=True)
class RunDir:
    """The paths of one run directory (see the module docstring); :meth:`create` makes it."""

    path: Path

    @classmethod
    def create(cls, job: str, path: Path | None = None, *, root: Path = DEFAULT_ROOT,
               now: datetime | None = None) -> RunDir:
        """``path`` as given (created if missing), else a new ``root/<job>-<YYYYmmdd-HHMMSS>[-N]``.

        Raises:
            ValueError: The directory cannot be created (names it and why).
        """
        try:
            if path is not None:
                path.mkdir(parents=True, exist_ok=True)
            else:
                path = _new_dir(root, f"{job}-{(now or datetime.now()).strftime('%Y%m%d-%H%M%S')}")
            run = cls(path)
            run.workers.mkdir(exist_ok=True)
            run.checkpoints.mkdir(exist_ok=True)
        except OSError as exc:
            where = path if path is not None else root
            raise ValueError(f"cannot create the run directory {where}: {exc.strerror or exc}; "
                             "set a writable one with logging.run_dir (--run-dir)") from exc
        if not os.access(path, os.W_OK):
            raise ValueError(f"the run directory {path} is not writable; set another with logging.run_dir "
                             "(--run-dir)")
        return run

    @property
    def plan_json(self) -> Path:
        return self.path / "plan.json"

    @property
    def plan_txt(self) -> Path:
        return self.path / "plan.txt"

    @property
    def record(self) -> Path:
        return self.path / "run.json"

    @property
    def coordinator_log(self) -> Path:
        return self.path / "coordinator.log"

    @property
    def workers(self) -> Path:
        return self.path / "workers"

    @property
    def trace(self) -> Path:
        return self.path / "trace.json"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def model(self) -> Path:
        return self.path / "model.pt"

    def write_record(self, record: RunRecord) -> None:
        write_atomic(self.record, record.model_dump_json(indent=2) + "\n")


def previous_checkpoint_roots(job: str, root: Path = DEFAULT_ROOT) -> list[Path]:
    """The ``checkpoints/`` of ``job``'s earlier default run directories (``root/<job>-*``), newest first."""
    if not root.is_dir():
        return []
    runs = [p for p in root.glob(f"{job}-*") if p.is_dir() and (p / "checkpoints").is_dir()]
    return [p / "checkpoints" for p in sorted(runs, key=lambda p: p.stat().st_mtime, reverse=True)]


def _new_dir(root: Path, name: str) -> Path:
    """``root/name``, or ``root/name-2``, ``-3``...: the first that did not exist (mkdir is the test)."""
    root.mkdir(parents=True, exist_ok=True)
    for n in range(1, MAX_SUFFIX + 1):
        candidate = root / (name if n == 1 else f"{name}-{n}")
        try:
            candidate.mkdir()
        except FileExistsError:
            continue
        return candidate
    raise FileExistsError(f"{MAX_SUFFIX} run directories named {root / name}[-N] already exist")
