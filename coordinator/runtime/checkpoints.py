"""The coordinator's side of checkpoints: when to save, publishing a complete one, finding the newest.

A checkpoint of step ``k`` (``k`` steps done) is a directory ``{root}/step-{k:08d}``:

* its root is a DCP checkpoint of the unwrapped model's ``state_dict`` (the keys
  ``model.state_dict()`` has): ``dcp_to_torch_save`` turns it into a file that loads into the
  model with ``strict=True``;
* ``train/`` is a DCP checkpoint of the training state by name: the optimizer's per-parameter
  state (``optim.{key}.{entry}``) and each stage's RNG state (``rng.r{replica}-s{stage}``);
* ``trainer.json``: the step, the data position (epoch and offset, for people: the batch of a
  step is a function of the step), the data it was trained on, the plan it was saved on, and
  under fp16 the loss scale's state (``coordinator/runtime/scaler.py``);
* ``parts/`` and ``train/parts/``: each service's files (see ``services/checkpoint/``).

Beside them, ``{root}/model.pt`` is the final ``state_dict`` of the last ``fit`` as a plain
file (``torch.load(path, weights_only=True)``).

[Note: how a checkpoint is taken]
The coordinator decides a checkpoint is due once step ``k - 1`` is done, creates a staging
directory ``.staging-step-{k:08d}-{random}`` and sends a :class:`~services.protocol.SaveRequest`
inside the commit of step ``k - 1`` (which travels with step ``k``'s request, or alone at the
end of a run). Each stage applies the update, copies its state to host memory and writes it
in the background while step ``k`` runs; each reply lists the parts finished since the last.
In parameter-server mode the shards save their optimizer state as parts of their own, at the
same update ([Note: a shard's part of a checkpoint] in ``coordinator/runtime/shards.py``).
When every service's part is in, the coordinator writes the two ``.metadata`` files and
``trainer.json`` into the staging directory and renames it ``step-{k:08d}``: the rename is
the commit of the checkpoint. Then the oldest beyond ``keep`` are removed. A part that fails
to be written drops that checkpoint (a warning; the previous ones stay). When the run fails,
:meth:`Checkpointer.salvage` publishes a staged checkpoint whose parts are all on storage even
if not all were reported yet (see [Note: salvaging after a failure]). A process killed
at any moment leaves the published checkpoints as they were, and at most a staging
directory, removed by the next checkpointer on that root.

[Note: salvaging after a failure]
The parts are written behind the steps (a part of a small model lands a few steps after its
commit, one of a large model many), so when a worker is lost the newest staged checkpoint is
often still being written by the live workers. The session rolls back to the newest published
checkpoint, so :meth:`Checkpointer.salvage` first settles each staged one, oldest first:

* every part on storage: published;
* a part missing whose worker is lost (the failure's worker, or one whose card vanished or
  changed incarnation): skipped at once, with a warning naming the parts and the workers. Its
  writer died with its process, so the part never comes;
* only parts of live workers missing: waited for, polling the storage, up to the step timeout
  (``runtime.step_timeout_s``) for all the staged checkpoints together; what is still missing
  then is skipped with a warning naming the parts, their workers and the time waited.

Before, a checkpoint still being written was dropped at once: a worker killed a step or two after
a checkpoint was due made the run roll back to the one before, and redo those steps.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict

from coordinator.runtime.errors import JobError
from coordinator.runtime.scaler import ScalerState
from services.checkpoint import dcp
from services.checkpoint.stage_state import TRAIN
from services.checkpoint.writer import part_dirs
from services.protocol import SavedPart, SaveRequest

__all__ = ["FINAL_MODEL", "Checkpointer", "TrainerState", "describe", "model_state", "newest", "read_trainer",
           "save_state_dict", "temporary_path"]

log = logging.getLogger(__name__)

TRAINER = "trainer.json"
FINAL_MODEL = "model.pt"  # the last fit's final state_dict, beside the step-* checkpoints
_PREFIX = "step-"
_STAGING = ".staging-"
_SALVAGE_POLL_S = 0.02  # how often a salvage looks for the parts live workers are writing
_LOST_EVERY_S = 0.25  # and asks which workers are lost


class TrainerState(BaseModel):
    """``trainer.json``: where training stood when the checkpoint was taken."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: int = 1
    job: str
    step: int  # steps done (optimizer updates): the next step to run
    epoch: int  # the data position of the next step (for people; the sampler derives it from the step)
    offset: int  # samples into that epoch
    global_batch: int
    num_samples: int
    seed: int
    shuffle: bool
    accumulate: int = 1  # global batches per step: a step's batches are step * accumulate onwards
    plan: str  # the plan it was saved on (any plan loads it)
    saved_at: float
    scaler: ScalerState | None = None  # fp16's loss scale as the next step takes it (None: not fp16)


def _name(step: int) -> str:
    return f"{_PREFIX}{step:08d}"


def _published(root: Path) -> list[tuple[int, Path]]:
    out: list[tuple[int, Path]] = []
    if root.is_dir():
        for path in root.iterdir():
            tail = path.name[len(_PREFIX):]
            if path.name.startswith(_PREFIX) and tail.isdigit() and (path / TRAINER).is_file():
                out.append((int(tail), path))
    return sorted(out)


def newest(root: Path) -> Path | None:
    """The newest complete checkpoint under ``root`` (a ``step-*`` directory), or None."""
    found = _published(root)
    return found[-1][1] if found else None


def read_trainer(checkpoint: Path) -> TrainerState:
    """The checkpoint's ``trainer.json``.

    Raises:
        dcp.CheckpointFormatError: It is missing or not a cellmesh trainer state.
    """
    try:
        return TrainerState.model_validate_json((checkpoint / TRAINER).read_bytes())
    except (OSError, ValueError) as exc:
        raise dcp.CheckpointFormatError(f"{checkpoint} is not a cellmesh checkpoint: {TRAINER}: "
                                        f"{exc}") from None


def model_state(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's model ``state_dict`` (the unwrapped model's keys), loaded into memory."""
    return dcp.load(checkpoint, list(dcp.keys(checkpoint)))


@dataclass
class _Pending:
    trainer: TrainerState
    staging: Path
    parts: set[str]
    model_parts: set[str] = field(default_factory=set)  # the parts with model tensors, as reported
    done: set[str] = field(default_factory=set)
    started: float = field(default_factory=time.monotonic)


class Checkpointer:
    """Takes and publishes the checkpoints of one run (see [Note: how a checkpoint is taken]).

    Args:
        root: Where the checkpoints go (created).
        every_steps: A checkpoint every N steps (None: not by steps).
        every_seconds: A checkpoint when T seconds passed since the last began (None: not by time).
        keep: How many published checkpoints to keep (the newest).
    """

    def __init__(self, root: Path, *, every_steps: int | None, every_seconds: float | None,
                 keep: int) -> None:
        self.root = root
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self.keep = keep
        self._last = time.monotonic()
        self._owed: int | None = None  # a step that was due while no commit could carry its save
        self._pending: dict[int, _Pending] = {}
        self.published: list[Path] = []
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(f"{_STAGING}*"):  # a save cut short by a crash: never published
            shutil.rmtree(stale, ignore_errors=True)

    def due(self, step: int) -> bool:
        """Whether to checkpoint once ``step`` steps are done (never twice for one step); also at the steps
        after one deferred (:meth:`defer`), until a checkpoint is begun."""
        if step == 0 or step in self._pending or any(k == step for k, _ in _published(self.root)[-1:]):
            return False
        if self.every_steps is not None:
            if step % self.every_steps == 0:
                return True
            if self._owed is not None and self._owed < step < self._owed + self.every_steps:
                return True
        return self.every_seconds is not None and time.monotonic() - self._last >= self.every_seconds

    def defer(self, step: int) -> None:
        """Checkpoint ``step`` was due but no commit completes that step (it was skipped: fp16's overflow,
        ``runtime.nonfinite: skip``), so no save can ride on one: take it at the next step instead."""
        if self._owed is None:
            self._owed = step

    def begin(self, trainer: TrainerState, parts: Iterable[str]) -> SaveRequest:
        """Stage checkpoint ``trainer.step``; the request for the commit that completes that step.

        ``parts`` names every service that writes a part (each reports whether it holds model tensors).
        """
        staging = self.root / f"{_STAGING}{_name(trainer.step)}-{secrets.token_hex(4)}"
        staging.mkdir(parents=True)
        self._pending[trainer.step] = _Pending(trainer, staging, set(parts))
        self._last = time.monotonic()
        self._owed = None
        return SaveRequest(directory=str(staging.resolve()), step=trainer.step)

    def cancel(self, step: int) -> None:
        """Drop checkpoint ``step`` (its save request never went out)."""
        pending = self._pending.pop(step, None)
        if pending is not None:
            shutil.rmtree(pending.staging, ignore_errors=True)

    @property
    def pending(self) -> list[int]:
        """The steps whose checkpoint is staged but not published yet."""
        return sorted(self._pending)

    def record(self, saved: Sequence[SavedPart]) -> list[Path]:
        """Take the parts the services report; publish each checkpoint that is complete. Its paths."""
        published: list[Path] = []
        for part in saved:
            pending = self._pending.get(part.step)
            if pending is None or part.part not in pending.parts:
                continue
            if part.error:
                log.warning("checkpoint of step %d dropped: part %s could not be written: %s", part.step,
                            part.part, part.error)
                self.cancel(part.step)
                continue
            pending.done.add(part.part)
            if part.model:
                pending.model_parts.add(part.part)
            if pending.done == pending.parts:
                published.append(self._publish(self._pending.pop(part.step)))
        return published

    def salvage(self, writers: Mapping[str, str] | None = None,
                lost: Callable[[], Collection[str]] = frozenset, timeout: timedelta = timedelta(0),
                ) -> list[Path]:
        """After a failure: publish each staged checkpoint whose parts are all on storage, though not
        all reported (a part is complete once its ``.metadata`` is there: DCP renames it last); drop
        the others (see [Note: salvaging after a failure]). The published paths.

        Args:
            writers: Each part's worker.
            lost: The workers lost now (asked again while waiting: another may be lost meanwhile).
            timeout: How long to wait, for every staged checkpoint together, for parts that live workers
                are still writing.
        """
        deadline = time.monotonic() + timeout.total_seconds()
        published: list[Path] = []
        for step in sorted(self._pending):
            if self._settle(step, writers or {}, lost, deadline, timeout):
                published.append(self._publish(self._pending.pop(step)))
            else:
                self.cancel(step)
        return published

    def _settle(self, step: int, writers: Mapping[str, str], lost: Callable[[], Collection[str]],
                deadline: float, timeout: timedelta) -> bool:
        """Whether every part of staged checkpoint ``step`` is on storage, waiting for live workers' parts
        until ``deadline``; False (a warning says why) when a part will not come."""
        pending, began, said = self._pending[step], time.monotonic(), False
        gone: set[str] = set()
        asked = -math.inf
        while True:
            missing = sorted(p for p in pending.parts
                             if not (part_dirs(pending.staging, p)[1] / dcp.METADATA).is_file())
            if not missing:  # a part's model files are complete before its training state is written
                pending.model_parts = {p for p in pending.parts
                                       if (part_dirs(pending.staging, p)[0] / dcp.METADATA).is_file()}
                if said:
                    log.info("checkpoint of step %d: its last parts were on storage %.2fs after the failure",
                             step, time.monotonic() - began)
                return True
            if time.monotonic() - asked >= _LOST_EVERY_S:  # a registry read: less often than the files
                gone, asked = set(lost()), time.monotonic()
            orphans = [p for p in missing if writers.get(p) in gone]
            of = ", ".join(sorted({writers.get(p, "?") for p in orphans or missing}))
            if orphans:
                log.warning("checkpoint of step %d skipped: part(s) %s not on storage, and their worker(s) "
                            "%s lost: a part's writer dies with its worker", step, ", ".join(orphans), of)
                return False
            if time.monotonic() >= deadline:
                log.warning("checkpoint of step %d skipped: waited %.1fs (runtime.step_timeout_s: %.1fs in "
                            "all) for part(s) %s that worker(s) %s were writing; not on storage yet", step,
                            time.monotonic() - began, timeout.total_seconds(), ", ".join(missing), of)
                return False
            if not said:
                log.info("checkpoint of step %d: waiting up to %.1fs for part(s) %s that worker(s) %s are "
                         "still writing", step, deadline - time.monotonic(), ", ".join(missing), of)
                said = True
            time.sleep(_SALVAGE_POLL_S)

    def _publish(self, pending: _Pending) -> Path:
        staging, step = pending.staging, pending.trainer.step
        dcp.merge_parts(staging, [part_dirs(staging, p)[0] for p in sorted(pending.model_parts)])
        dcp.merge_parts(staging / TRAIN, [part_dirs(staging, p)[1] for p in sorted(pending.parts)])
        trainer = staging / TRAINER
        with open(trainer, "w") as out:
            out.write(pending.trainer.model_dump_json(indent=2))
            out.flush()
            os.fsync(out.fileno())
        final = self.root / _name(step)
        dcp.publish(staging, final)
        log.info("checkpoint of step %d published in %s (%.2fs after it was taken)", step, final,
                 time.monotonic() - pending.started)
        self.published.append(final)
        doomed = []
        for _, path in _published(self.root)[:-self.keep]:  # renamed now: never taken for a checkpoint again
            doomed.append(path.with_name(f"{_STAGING}removed-{path.name}-{secrets.token_hex(4)}"))
            os.rename(path, doomed[-1])
        if doomed:  # removed off the step's path: a large checkpoint's files take a while
            threading.Thread(target=_remove, args=(doomed,), daemon=True, name="checkpoint-prune").start()
        return final


def _remove(paths: list[Path]) -> None:
    for path in paths:  # a staging name: if this is cut short, the next checkpointer removes the rest
        shutil.rmtree(path, ignore_errors=True)


def describe(checkpoint: Path) -> str:
    """One line for people: which step, saved when, on which plan."""
    trainer = read_trainer(checkpoint)
    return (f"{checkpoint} (step {trainer.step}, epoch {trainer.epoch}, saved "
            f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(trainer.saved_at))} on {trainer.plan})")


def save_state_dict(state: dict[str, torch.Tensor], path: Path) -> None:
    """``torch.save`` plain, contiguous CPU tensors to ``path`` atomically (a temporary file, then rename):
    the final model as a file ``torch.load(path, weights_only=True)`` reads.

    Raises:
        OSError: The directory cannot be created or written.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    plain = {k: v.detach().cpu().contiguous().clone() for k, v in state.items()}
    tmp = temporary_path(path)  # open() applies the umask, as for any output
    try:
        with open(tmp, "wb") as f:
            torch.save(plain, f)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def temporary_path(path: Path) -> Path:
    """The temporary file :func:`save_state_dict` writes beside ``path`` before renaming it."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def checkpoint_key(job: str) -> str:
    """The registry key naming job ``job``'s newest checkpoint (a restarted coordinator reads it)."""
    return f"/cellmesh/{job}/checkpoint"


def state_keys(model: torch.nn.Module, named: Sequence[tuple[str, torch.Tensor]]) -> dict[str, list[str]]:
    """Each tensor's name in the stages (``Chain.named_tensors``) -> its keys in ``model.state_dict()``
    (tied: several)."""
    by_id: dict[int, str] = {id(t): n for n, t in named}
    out: dict[str, list[str]] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        name = by_id.get(id(value))
        if name is not None:
            out.setdefault(name, []).append(key)
    return out


def resolve_resume(resume: Path | str | bool, root: str | None) -> Path | None:
    """The checkpoint ``resume`` means: a ``step-*`` directory, the newest under a directory, or (True)
    the newest under the job's ``checkpoint.directory``; None when that directory has none yet.

    Raises:
        JobError: ``resume`` is True but the job has no checkpoint directory, or a path holds no checkpoint.
    """
    if resume is True:
        if root is None:
            raise JobError("resume=True needs the job's checkpoint.directory (or give the checkpoint's "
                           "path: --resume DIR)")
        found = newest(Path(root))
        if found is None:
            log.warning("no checkpoint under %s yet: training starts from the beginning", root)
        return found
    path = Path(str(resume))
    if (path / "trainer.json").is_file():
        return path
    found = newest(path)
    if found is None:
        raise JobError(f"--resume {path}: no complete checkpoint there (a step-* directory with "
                       "trainer.json)")
    return found
