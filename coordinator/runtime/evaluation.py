"""Evaluation on held-out data, on the training plan and services: after every N steps and after a fit.

[Note: how a job evaluates]
A job with an ``eval`` section (:class:`~coordinator.planning.config.EvalConfig`) evaluates its
model on the samples of its held-out data factory:

* when: after every ``eval.every_steps`` steps (counted from the job's start) and after the last
  step of every ``fit``. The result rides on that step's record (``StepRecord.eval``), so the
  progress display, the run record, the metrics and TensorBoard show it with its step, and
  ``FitResult.evals`` lists them;
* on what: the whole held-out set, in order, never shuffled, in batches of ``eval.global_batch``
  (default ``data.global_batch``), the last one holding what is left (37 samples in batches of
  16: 16, 16, 5). A batch is split as a training batch is (``coordinator/planning/data.py``):
  contiguous shares over the plan's replicas, each into the plan's microbatches; here their
  sizes may differ by one sample (:func:`split_eval_batch`), and a replica with no sample of a
  short batch sits it out;
* under ZeRO-3 every forward gathers its units' parameters from the whole sharding group, so every
  replica must run as many forwards as the others: a replica with fewer microbatches of a batch (or
  none) runs extra one-sample microbatches (:func:`pad_eval_split`, the batch's first sample) whose
  loss and metric are left out of the sums;
* how: the last step's update is committed first (a ``commit`` round carrying the checkpoint due
  at this step, or the final one at the end of a fit), so the evaluation sees the updated model
  and no checkpoint is skipped. Then each batch is one evaluation step: a ``RunStep`` with
  ``source="eval"``, a forward-only action list (:func:`forward_actions`) and ``zero_grad`` off.
  The services run it with the modules in eval mode and the RNG forked
  (``services/compute/executor.py``): no gradient, buffer or RNG state changes, so the
  parameters after a fit are bit-identical with and without evaluation;
* what it reports: the means over the held-out samples. The last stage returns each
  microbatch's loss (the loss function's mean over its ``n`` samples, as in training) and the
  sum of the metric over them (``services.compute.stage.metric_sum``: a metric returns one value
  per sample or their mean); :class:`HeldOutSums` makes ``sum(loss_m * n_m) / N`` and
  ``sum(metric_m) / N`` of them, exact for uneven microbatches and a short last batch.

``coordinator/runtime/reference.py`` evaluates one process's model on the whole held-out set at
the same steps; the tests hold cellmesh's evaluations equal to it.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from coordinator.planning.config import EvalConfig, JobConfig
from coordinator.planning.schedules import Schedule
from coordinator.runtime.errors import JobError
from coordinator.runtime.factories import build_data
from coordinator.runtime.records import EvalRecord
from services.protocol import Action, ActionKind, SavedPart

if TYPE_CHECKING:
    from coordinator.runtime.driver import Runtime

__all__ = ["Evaluation", "HeldOutSums", "eval_batches", "forward_actions", "held_out_count",
           "pad_eval_split", "split_eval_batch"]


def eval_batches(num_samples: int, global_batch: int) -> list[list[int]]:
    """The held-out indices in order, in batches of ``global_batch`` (the last one holds what is left)."""
    return [list(range(start, min(start + global_batch, num_samples)))
            for start in range(0, num_samples, global_batch)]


def _runs(indices: list[int], parts: int) -> list[list[int]]:
    """``indices`` in ``parts`` contiguous runs whose lengths differ by one at most (the longer first)."""
    size, extra = divmod(len(indices), parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + size + (i < extra)
        out.append(indices[start:stop])
        start = stop
    return out


def split_eval_batch(indices: list[int], data_parallel: int, num_microbatches: int) -> list[list[list[int]]]:
    """``indices`` as ``[replica][microbatch] -> sample indices``, contiguous, as ``split_batch`` splits a
    training batch, but of any length: sizes differ by one at most and empty microbatches are left out
    (a replica may get none)."""
    return [[mb for mb in _runs(share, num_microbatches) if mb] for share in _runs(indices, data_parallel)]


def pad_eval_split(split: list[list[list[int]]]) -> list[list[list[int]]]:
    """``split`` with every replica's microbatches made as many as the most any replica has, by adding
    one-sample microbatches of the batch's first sample (for ZeRO-3, whose forwards gather together;
    the added ones' results are not counted: only the first ``len(split[r])`` are)."""
    most = max(len(mbs) for mbs in split)
    first = next(mb[0] for mbs in split for mb in mbs)
    return [[*mbs, *([first] for _ in range(most - len(mbs)))] for mbs in split]


@functools.lru_cache(maxsize=64)
def forward_actions(num_stages: int, num_microbatches: int) -> tuple[tuple[Action, ...], ...]:
    """Every stage's evaluation list: per microbatch, receive the inputs, forward, send the outputs on
    (validated as a schedule: eager sends never wait, so it cannot deadlock)."""
    stages = []
    for s in range(num_stages):
        has: dict[ActionKind, bool] = {"RECV_F": s > 0, "F": True, "SEND_F": s < num_stages - 1}
        kinds = [k for k, present in has.items() if present]
        stages.append(tuple(Action(stage=s, kind=k, microbatch=i) for i in range(num_microbatches)
                            for k in kinds))
    return Schedule("forward", num_microbatches, tuple(stages)).actions


@dataclass
class HeldOutSums:
    """The last stages' reports of an evaluation, summed: samples, ``loss * n`` and the metric's sums."""

    samples: int = 0
    loss: float = 0.0
    metric: float | None = None  # None: no metric reported

    def add(self, microbatches: Sequence[Sequence[int]], losses: Sequence[float],
            metric_sums: Sequence[float]) -> None:
        """Count one last stage's reply to the evaluation of ``microbatches``.

        Raises:
            ValueError: The reply has another number of losses or metric sums than microbatches.
        """
        if len(losses) != len(microbatches) or len(metric_sums) not in (0, len(microbatches)):
            raise ValueError(f"an evaluation of {len(microbatches)} microbatches was answered with "
                             f"{len(losses)} losses and {len(metric_sums)} metric sums")
        for mb, loss in zip(microbatches, losses, strict=True):
            self.samples += len(mb)
            self.loss += loss * len(mb)
        if metric_sums:
            self.metric = (self.metric or 0.0) + sum(metric_sums)

    def record(self, step: int, seconds: float) -> EvalRecord:
        """The means over the samples counted."""
        n = max(1, self.samples)
        metric = None if self.metric is None else self.metric / n
        return EvalRecord(step=step, loss=self.loss / n, metric=metric, num_samples=self.samples,
                          seconds=seconds)


def held_out_count(config: JobConfig) -> int:
    """How many held-out samples ``config``'s ``eval`` section serves (its ``num_samples``, else its pair's).

    Raises:
        JobError: The job has no eval section, or its factory returns a loader and no ``num_samples``
            is given (or raises: ``coordinator/runtime/factories.py``).
    """
    section = config.eval
    if section is None:
        raise JobError("the job has no eval section")
    n = section.num_samples or build_data(section.factory, section.kwargs, config.data.seed,
                                          section="eval").num_samples
    if n is None:
        raise JobError(f"eval factory {section.factory!r} returns a loader: give eval.num_samples "
                       "(Job(eval_num_samples=...))")
    return n


class Evaluation:
    """One job's evaluation: its held-out batches, when it is due, and running it on a runtime.

    Args:
        section: The job's eval section.
        num_samples: The held-out samples (:func:`held_out_count`).
        global_batch: The batch when the section gives none (``data.global_batch``).
    """

    def __init__(self, section: EvalConfig, num_samples: int, global_batch: int) -> None:
        self.every_steps = section.every_steps
        self.batches = eval_batches(num_samples, section.global_batch or global_batch)

    @classmethod
    def of(cls, config: JobConfig) -> Evaluation | None:
        """The evaluation ``config`` asks for, or None without an eval section.

        Raises:
            JobError: See :func:`held_out_count`.
        """
        if config.eval is None:
            return None
        return cls(config.eval, held_out_count(config), config.data.global_batch)

    def due(self, done: int, end: int) -> bool:
        """Whether to evaluate once ``done`` steps are done, in a fit that ends at step ``end``."""
        return done == end or (self.every_steps is not None and done % self.every_steps == 0)

    def run(self, runtime: Runtime, done: int) -> tuple[EvalRecord, list[SavedPart]]:
        """Evaluate the model ``runtime`` holds after ``done`` steps (its last update committed); the
        checkpoint parts the services reported meanwhile (for the checkpointer).

        Raises:
            JobFailed: A service failed or vanished (naming it).
        """
        start = time.monotonic()
        plan, sums, saved = runtime.plan, HeldOutSums(), []
        for batch in self.batches:
            split = split_eval_batch(batch, plan.data_parallel, plan.num_microbatches)
            replies, parts = runtime.evaluate(done, pad_eval_split(split) if plan.zero_stage == 3 else split)
            saved += parts
            for replica, reply in replies:
                real = len(split[replica])  # the padding's results (ZeRO-3) are not counted
                sums.add(split[replica], reply.losses[:real], reply.metric_sums[:real])
        return sums.record(done, time.monotonic() - start), saved
