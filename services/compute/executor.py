"""Runs one stage's ordered action list for one step: forward, backward, and the transfers between.

The list is executed as given, one action after the other, on the calling thread.
Transfers never block the action that issues them:

* ``SEND_F`` / ``SEND_B`` post an ``isend`` per tensor and move on; sends are
  awaited only at the end of the step (their tensors stay referenced until then).
* ``RECV_F`` / ``RECV_B`` post an ``irecv`` per tensor into fresh buffers; the ``F`` /
  ``B`` of that microbatch waits for them, so a receive posted early overlaps whatever
  the list runs in between::

      stage 1:  1RECV_F0 1RECV_F1 | 1F0 (waits 1RECV_F0) | 1F1 (waits 1RECV_F1) | ...
                posted              data arrives meanwhile, into libzmq/gloo buffers

Gradients. A received input that carries a gradient (``requires_grad`` in the incoming
spec) becomes a leaf with ``requires_grad``; on ``backward`` the stage runs
``torch.autograd.backward(outputs, received output gradients)`` (on the last stage:
``loss * weight``), and ``SEND_B`` sends each such input's ``.grad`` (zeros if the
input did not reach the outputs). Tensors without gradients cross the cut too; nothing
comes back for them. Parameter gradients accumulate over the step's microbatches. A
list without backwards (an evaluation step) runs its forwards without autograd.

Loss weighting. With ``loss_reduction="mean"`` microbatch ``m`` of ``n_m`` samples
contributes ``loss_m * n_m / N`` (``N`` samples in the step), so the gradients equal
those of the mean loss over the whole batch, for uneven microbatches too; ``"sum"``
weighs each by 1. Reported losses are unweighted.

Timings (``time.time()`` seconds, one per action): compute actions from the moment
their inputs are in hand to the end of the compute; receives from posting to the moment
their data was waited for; sends from posting to the first action boundary (or the end
of the step) at which they were seen complete.

Gradient path. With a :class:`~services.params.grad_path.GradientPath`, the executor arms it
just before the list's last backward and finishes it after the sends (a collective path
then holds the gradients averaged over the stage's replicas); its timing is a phase of
the reply. See [Note: microbatches and the all-reduce] in ``services/params/grad_path.py``.

Non-finite values. The reply names the parameters whose gradient (after the gradient path:
averaged over the replicas in collective mode) holds a NaN or Inf, as AMP's ``GradScaler``
checks; with the losses it reports, the coordinator decides whether the step's update is
applied (see [Note: a step that is not finite] in ``coordinator/runtime/nonfinite.py``).

Every wait is bounded by the step's deadline; errors are raised as :class:`StepFailed`
naming the stage, the step and the action.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from comm.base import Communicator, Work
from services import faults
from services.compute.boundary import empty_buffers, flatten, transfer_tag, unflatten
from services.compute.stage import Stage
from services.params.grad_path import GradientPath
from services.protocol import MAX_NONFINITE_NAMED, Action, ActionKind, PhaseTiming, RunStep, StepReply

__all__ = ["StepExecutor", "StepFailed", "nonfinite"]

_FAULT_PHASES: dict[str, faults.Phase] = {"F": "forward", "B": "backward"}

_Buffers = list[tuple[int, torch.Tensor]]  # (index in the boundary spec, tensor)


class StepFailed(RuntimeError):
    """A step could not finish; the message names stage, step and action.

    Attributes:
        transfers_posted: True if the step had posted a send or receive before it failed
            (the communicator's channels may then hold stray messages).
    """

    def __init__(self, message: str, *, transfers_posted: bool) -> None:
        super().__init__(message)
        self.transfers_posted = transfers_posted


@dataclass
class _Microbatch:
    """One microbatch's state between its actions (dropped at the end of the step)."""

    samples: list[int]
    # kind -> (action index, works, (tensor index, buffer)) of receives posted, not yet waited for
    recv_works: dict[ActionKind, tuple[int, list[Work], _Buffers]] = field(default_factory=dict)
    inputs: list[torch.Tensor] = field(default_factory=list)
    targets: Any = None
    outputs: list[torch.Tensor] = field(default_factory=list)
    loss: torch.Tensor | None = None
    input_grads: list[tuple[int, torch.Tensor]] = field(default_factory=list)


class StepExecutor:
    """Executes one :class:`RunStep` on ``stage``; single use.

    Args:
        stage: The stage's module, samples and loss.
        comm: The pipeline communicator (rank = stage index); None for a one-stage pipeline.
        request: The step; its action list must have passed ``validate_stage``.
        trains: True if the list runs backwards (``validate_stage``'s answer); False: an
            evaluation step, whose forwards run without autograd.
        deadline: ``time.monotonic()`` by which the step must end.
        grad_path: The stage's gradient path (already begun), if its gradients meet other replicas'.
    """

    def __init__(self, stage: Stage, comm: Communicator | None, request: RunStep,
                 trains: bool, deadline: float,
                 grad_path: GradientPath | None = None) -> None:
        self._stage = stage
        self._grad_path = grad_path
        backwards = [k for k, a in enumerate(request.actions) if a.kind == "B"]
        self._last_backward = backwards[-1] if backwards else None
        self._comm = comm
        self._request = request
        self._trains = trains
        self._deadline = deadline
        self._mbs = [_Microbatch(list(s)) for s in request.microbatches]
        total = sum(len(s) for s in request.microbatches)
        self._weights = [len(s) / total if stage.loss_reduction == "mean" else 1.0
                         for s in request.microbatches]
        self._starts = [0.0] * len(request.actions)
        self._ends: list[float | None] = [None] * len(request.actions)
        self._sends: list[tuple[int, Work, torch.Tensor]] = []
        self._losses: list[float] = [0.0] * len(self._mbs) if stage.last else []
        self._posted = False
        self._k = 0

    def run(self) -> StepReply:
        """Run every action in order, then wait for the sends.

        Raises:
            StepFailed: an action raised, a transfer failed or the deadline passed.
        """
        if self._request.zero_grad:
            for _, p in self._stage.parameters():
                p.grad = None
        handlers = {"F": self._forward, "B": self._backward, "SEND_F": self._send_act,
                    "RECV_F": self._recv_act, "SEND_B": self._send_grad, "RECV_B": self._recv_grad}
        action: Action | None = None
        phases: list[PhaseTiming] = []
        try:
            for k, action in enumerate(self._request.actions):
                self._k = k
                if k == self._last_backward and self._grad_path is not None:
                    self._grad_path.arm()
                if action.microbatch == 0 and action.kind in _FAULT_PHASES:
                    faults.at(self._request.step, _FAULT_PHASES[action.kind])
                self._starts[k] = time.time()
                handlers[action.kind](self._mbs[action.microbatch], action)
                if action.kind in ("F", "B"):
                    self._ends[k] = time.time()
                self._poll_sends()
            action = None
            for k, work, _ in self._sends:
                work.wait(self._left("the step's sends"))
                self._ends[k] = time.time()
            if self._grad_path is not None and self._last_backward is not None:
                faults.at(self._request.step, "sync")
                phase = self._grad_path.finish(self._left("the gradient synchronisation"))
                phases += [phase] if phase is not None else []
            nonfinite = self._nonfinite_grads() if self._last_backward is not None else []
        except StepFailed:
            raise
        except Exception as exc:
            at = self._where() if action is not None else (
                f"stage {self._stage.index}, step {self._request.step}, waiting for the sends and the "
                "gradient synchronisation")
            raise StepFailed(f"{at}: {type(exc).__name__}: {exc}", transfers_posted=self._posted) from exc
        ends = [e if e is not None else s for s, e in zip(self._starts, self._ends, strict=True)]
        return StepReply(step=self._request.step, stage=self._stage.index, losses=self._losses,
                         starts=self._starts, ends=ends, phases=phases, nonfinite_grads=nonfinite)

    # -- plumbing ---------------------------------------------------------------------

    def _nonfinite_grads(self) -> list[str]:
        """The parameters whose gradient holds a NaN or Inf (the first ``MAX_NONFINITE_NAMED``)."""
        grads = [(name, p.grad) for name, p in self._stage.parameters() if p.grad is not None]
        return nonfinite(grads)[:MAX_NONFINITE_NAMED]

    def _where(self) -> str:
        return (f"stage {self._stage.index}, step {self._request.step}, action #{self._k} "
                f"({self._request.actions[self._k]})")

    def _left(self, what: str) -> timedelta:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise StepFailed(f"{self._where()}: the step's {self._request.timeout_ms / 1000:.1f}s ran out "
                             f"before {what}", transfers_posted=self._posted)
        return timedelta(seconds=left)

    def _poll_sends(self) -> None:
        now = time.time()
        pending: dict[int, bool] = {}
        for k, work, _ in self._sends:
            pending[k] = pending.get(k, False) or not work.is_completed()
        for k, busy in pending.items():
            if not busy and self._ends[k] is None:
                self._ends[k] = now
        self._sends = [s for s in self._sends if pending[s[0]]]

    def _post_recvs(self, mb: _Microbatch, action: Action, buffers: _Buffers) -> None:
        assert self._comm is not None and action.peer is not None
        m = action.microbatch
        works = [self._comm.irecv(buf, action.peer, tag=transfer_tag(m, i)) for i, buf in buffers]
        self._posted = self._posted or bool(works)
        mb.recv_works[action.kind] = (self._k, works, buffers)
        if not works:
            self._ends[self._k] = time.time()

    def _wait_recvs(self, mb: _Microbatch, kind: ActionKind, what: str) -> _Buffers:
        k, works, buffers = mb.recv_works.pop(kind)
        for work in works:
            try:
                work.wait(self._left(what))
            except StepFailed:
                raise
            except Exception as exc:
                raise StepFailed(f"{self._where()}: waiting for {what}: {type(exc).__name__}: {exc}",
                                 transfers_posted=True) from exc
        if self._ends[k] is None:
            self._ends[k] = time.time()
        self._starts[self._k] = time.time()  # compute starts once its inputs are in hand
        return buffers

    def _post_sends(self, action: Action, tensors: list[tuple[int, torch.Tensor]]) -> None:
        assert self._comm is not None and action.peer is not None
        for i, t in tensors:
            t = t.detach().contiguous()
            work = self._comm.isend(t, action.peer, tag=transfer_tag(action.microbatch, i))
            self._sends.append((self._k, work, t))
            self._posted = True
        if not tensors:
            self._ends[self._k] = time.time()

    # -- the six kinds of action ------------------------------------------------------

    def _recv_act(self, mb: _Microbatch, action: Action) -> None:
        assert self._stage.incoming is not None
        self._post_recvs(mb, action, empty_buffers(self._stage.incoming, len(mb.samples)))

    def _recv_grad(self, mb: _Microbatch, action: Action) -> None:
        assert self._stage.outgoing is not None
        self._post_recvs(mb, action, empty_buffers(self._stage.outgoing, len(mb.samples), grad_only=True))

    def _forward(self, mb: _Microbatch, action: Action) -> None:
        stage, m, grad = self._stage, action.microbatch, self._trains
        if stage.first or stage.last:
            assert stage.samples is not None
            inputs, mb.targets = stage.samples.load(mb.samples)
        if not stage.first:
            assert stage.incoming is not None
            buffers = self._wait_recvs(mb, "RECV_F",
                                       f"microbatch {m}'s activations from stage {stage.index - 1}")
            for (_, buf), spec in zip(buffers, stage.incoming.tensors, strict=True):
                buf.requires_grad_(grad and spec.requires_grad)
            mb.inputs = [buf for _, buf in buffers]
            inputs = unflatten(stage.incoming, mb.inputs)
        with torch.set_grad_enabled(grad):
            out = stage.module(inputs)
            if stage.last:
                assert stage.loss_fn is not None
                loss = stage.loss_fn(out, mb.targets)
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise ValueError(f"the loss must be a one-element tensor, got {type(loss).__name__}"
                                     f"{list(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
                mb.loss = loss
                self._losses[m] = float(loss.detach().reshape(()).item())
            else:
                assert stage.outgoing is not None
                mb.outputs = flatten(stage.outgoing, out, len(mb.samples), check_grad=grad,
                                     where=f"stage {stage.index} microbatch {m} output")
        mb.targets = None

    def _send_act(self, mb: _Microbatch, action: Action) -> None:
        self._post_sends(action, list(enumerate(mb.outputs)))
        if not self._trains:
            mb.outputs = []

    def _backward(self, mb: _Microbatch, action: Action) -> None:
        stage, m = self._stage, action.microbatch
        if stage.last:
            assert mb.loss is not None
            torch.autograd.backward([(mb.loss * self._weights[m]).reshape(())])
        else:
            grads = self._wait_recvs(mb, "RECV_B",
                                     f"microbatch {m}'s gradients from stage {stage.index + 1}")
            pairs = [(mb.outputs[i], g) for i, g in grads if mb.outputs[i].requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        if not stage.first:
            assert stage.incoming is not None
            mb.input_grads = [
                (i, x.grad if x.grad is not None else torch.zeros_like(x))
                for i, (x, spec) in enumerate(zip(mb.inputs, stage.incoming.tensors, strict=True))
                if spec.requires_grad
            ]
        mb.inputs, mb.outputs, mb.loss = [], [], None

    def _send_grad(self, mb: _Microbatch, action: Action) -> None:
        self._post_sends(action, mb.input_grads)
        mb.input_grads = []


def nonfinite(named: list[tuple[str, torch.Tensor]]) -> list[str]:
    """The names of the tensors that hold a NaN or an Inf, in order.

    A finite sum proves a tensor finite (a NaN or an Inf makes its sum NaN or Inf), at the cost
    of one read of the tensors (~1 ms for 34 MB here, where ``isfinite(g).all()`` allocates a
    mask per tensor: ~20 ms); a sum that overflowed to Inf from finite values is checked
    element by element, so the answer is exact.
    """
    if not named:
        return []
    sums = torch.stack([t.sum() for _, t in named]).isfinite().tolist()
    if all(sums):
        return []
    return [name for (name, t), ok in zip(named, sums, strict=True)
            if not ok and not bool(torch.isfinite(t).all())]
