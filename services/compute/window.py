"""The commit of a step inside a window, decided by the stages: their reports, stage 0's verdict.

See [Note: a window of steps] in ``services/protocol/compute.py``. A :class:`Report` is what the
coordinator reads from a stage's reply to decide a commit (whether its losses and gradients are finite,
its gradients' squared norm); :func:`decide` is the coordinator's decision on them
(``coordinator/runtime/nonfinite.py``'s check, ``coordinator/runtime/clipping.py``'s coefficient);
:func:`agree` moves the reports to stage 0 and its verdict to every stage over the pipeline's
communicator, so every stage applies the same verdict.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import torch

from comm.base import Communicator
from services.params.clipping import clip_coefficient
from services.protocol import StepReply
from services.protocol.compute import MAX_BOUNDARY_TENSORS

__all__ = ["REPORT_TAG", "VERDICT_TAG", "Report", "Verdict", "agree", "decide"]

# above every transfer tag (microbatch * MAX_BOUNDARY_TENSORS + index, microbatches < 2**16)
REPORT_TAG = (1 << 16) * MAX_BOUNDARY_TENSORS + 1
VERDICT_TAG = REPORT_TAG + 1

_COMMIT, _SKIP, _STOP = 0.0, 1.0, 2.0


@dataclass(frozen=True)
class Report:
    """What one stage's step says about the step's commit."""

    finite: bool  # its losses (the last stage's) and its gradients are all finite
    sq_norm: float | None  # its gradients' squared L2 norm (StepReply.grad_sq_norm)
    closing: bool = False  # its service is closing (its worker drains): the window ends here, everywhere

    @classmethod
    def of(cls, reply: StepReply, closing: bool = False) -> Report:
        finite = not reply.nonfinite_grads and all(math.isfinite(v) for v in reply.losses)
        return cls(finite=finite, sq_norm=reply.grad_sq_norm, closing=closing)

    def tensor(self, device: torch.device | str) -> torch.Tensor:
        sq = self.sq_norm
        return torch.tensor([1.0 if self.finite else 0.0, 0.0 if sq is None else 1.0, sq or 0.0,
                             1.0 if self.closing else 0.0], dtype=torch.float64, device=device)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> Report:
        finite, has_norm, sq, closing = t.tolist()
        return cls(finite=finite == 1.0, sq_norm=sq if has_norm == 1.0 else None, closing=closing == 1.0)


@dataclass(frozen=True)
class Verdict:
    """Stage 0's decision on a step: commit it (multiplying the gradients by ``grad_scale``), skip it, or
    stop the window there."""

    action: Literal["commit", "skip", "stop"]
    grad_scale: float = 1.0

    def tensor(self, device: torch.device | str) -> torch.Tensor:
        code = {"commit": _COMMIT, "skip": _SKIP, "stop": _STOP}[self.action]
        return torch.tensor([code, self.grad_scale], dtype=torch.float64, device=device)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> Verdict:
        code, scale = t.tolist()
        action: Literal["commit", "skip", "stop"] = "commit" if code == _COMMIT else (
            "skip" if code == _SKIP else "stop")
        return cls(action=action, grad_scale=scale)


def decide(reports: list[Report], clip_grad_norm: float | None, nonfinite: Literal["stop", "skip"]
           ) -> Verdict:
    """The verdict on a step whose stages (in stage order) reported ``reports``: what the coordinator
    decides from their replies. Not finite anywhere: ``nonfinite`` (stop or skip). Else commit, with the
    clipping coefficient of the stages' norms added up (1 without clipping, or when a stage has no norm).
    A stage closing stops the window there, the step not committed (the coordinator commits it, or its
    successor rolls back)."""
    if any(r.closing for r in reports):
        return Verdict(action="stop")
    if not all(r.finite for r in reports):
        return Verdict(action=nonfinite)
    norms = [r.sq_norm for r in reports]
    if clip_grad_norm is None or any(n is None for n in norms):
        return Verdict(action="commit")
    return Verdict(action="commit", grad_scale=clip_coefficient(sum(n for n in norms if n is not None),
                                                                clip_grad_norm))


def agree(comm: Communicator | None, stage: int, num_stages: int, reply: StepReply,
          clip_grad_norm: float | None, nonfinite: Literal["stop", "skip"], device: torch.device | str,
          timeout: timedelta, group: Communicator | None = None, group_device: torch.device | str = "cpu",
          closing: bool = False) -> Verdict:
    """The verdict every stage of every replica applies to the step ``reply`` answers (this stage's).

    With replicas (``group``: the stage's data-parallel communicator), the stage first adds up over the
    group whether each replica's report is finite: the replicas' gradients are the same after their
    all-reduce, their losses are not, so a loss that is not finite in one replica counts in every one.
    Then stage 0 of each replica receives every other stage's report, decides and sends the verdict to
    each; the others send their report and wait for it. Every replica's stage 0 decides on the same
    reports, so every replica applies the same verdict. ``device`` / ``group_device``: where each
    communicator takes its tensors. Each wait is bounded by ``timeout``. ``closing``: this stage's
    service is closing, which every stage of every replica learns with the verdict (a window ends at the
    same step everywhere, so no stage waits on one that left).

    Raises:
        TimeoutError: A report or the verdict did not come within ``timeout`` (naming which).
        RuntimeError: A communicator failed.
    """
    own = Report.of(reply, closing)
    if group is not None and group.world_size > 1:
        bad = torch.tensor([0.0 if own.finite else 1.0, 1.0 if own.closing else 0.0], dtype=torch.float64,
                           device=group_device)
        try:
            group.all_reduce(bad, timeout=timeout)
        except TimeoutError as exc:
            raise TimeoutError(f"stage {stage}: the replicas' reports on step {reply.step} did not meet "
                               f"within {timeout.total_seconds():.1f}s: {exc}") from exc
        not_finite, closing_ = bad.tolist()
        own = Report(finite=not_finite == 0.0, sq_norm=own.sq_norm, closing=closing_ > 0.0)
    if comm is None or num_stages == 1:
        return decide([own], clip_grad_norm, nonfinite)
    if stage != 0:
        comm.isend(own.tensor(device), 0, tag=REPORT_TAG).wait(timeout)
        got = torch.empty(2, dtype=torch.float64, device=device)
        try:
            comm.irecv(got, 0, tag=VERDICT_TAG).wait(timeout)
        except TimeoutError as exc:
            raise TimeoutError(f"stage {stage}: stage 0's verdict on step {reply.step}'s commit did not come "
                               f"within {timeout.total_seconds():.1f}s: {exc}") from exc
        return Verdict.from_tensor(got.cpu())
    reports = [own]
    for peer in range(1, num_stages):
        got = torch.empty(4, dtype=torch.float64, device=device)
        try:
            comm.irecv(got, peer, tag=REPORT_TAG).wait(timeout)
        except TimeoutError as exc:
            raise TimeoutError(f"stage 0: stage {peer}'s report on step {reply.step} did not come within "
                               f"{timeout.total_seconds():.1f}s: {exc}") from exc
        reports.append(Report.from_tensor(got.cpu()))
    verdict = decide(reports, clip_grad_norm, nonfinite)
    sent = verdict.tensor(device)
    works = [comm.isend(sent, peer, tag=VERDICT_TAG) for peer in range(1, num_stages)]
    for work in works:
        work.wait(timeout)
    return verdict
