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
list without backwards runs its forwards without autograd.

[Note: received values change in place] The stage module gets a copy (``clone``) of each received
leaf it differentiates, never the leaf itself: a stage may begin with an in-place operation on
what it receives (``nn.ReLU(inplace=True)`` right after the cut, ``h += skip`` on a skip
connection), which autograd refuses on a leaf that requires a gradient ("a leaf Variable that
requires grad is being used in an in-place operation"), while one process runs it on an
intermediate value. The gradient reaches the leaf through the copy. The cost is one copy of the
stage's inputs per microbatch (memory: that copy while the microbatch is in flight, where the
stage's first operation keeps its input for the backward). The profile feeds each node copies too
(``coordinator/planning/profile.py``).

A backward split in two (zero bubble: ``I`` then ``W``, see ``services/compute/actions.py``). ``I``
runs the backward above with the stage's linear layers deferring their weight gradients
(``services/compute/weight_grads.py``, [Note: splitting a backward]): it yields what ``SEND_B``
sends and every other parameter's gradient. A run of consecutive ``W`` s computes its microbatches'
deferred gradients at once, one product per layer; the first ``W`` after the list's last ``I``
computes all that are left. Under ``bf16``/``fp16`` nothing is deferred: ``I`` is the whole
backward and ``W`` has nothing to do. A GPipe list (every ``B`` after every ``F``) defers too: its
last ``B`` ends with every microbatch's weight gradients, one product per layer
(:func:`~services.compute.weight_grads.defers` says which lists do). Any other list (1F1B,
interleaved 1F1B) runs each ``B`` between its first and its last as ``I`` and that microbatch's ``W``,
added into ``.grad`` in place (fp32/fp64; [Note: a backward's weight gradients in place] in
``services/compute/weight_grads.py``): held, and computed with the next ``B`` s' in one product per
layer once they hold more than 1/8 of the weights' bytes, and before the last ``B``.

[Note: the last W after the send]
The stage before waits for the input gradients of a stage's last backward, and nothing waits for its
weight gradients. So the step's last weight gradients are computed after that backward's ``SEND_B``
has handed the input gradients over: GPipe's one product per layer over every microbatch (10-13 ms a
stage here: 4 x Linear(1024), 64 rows), and a 1F1B list's held ``W`` s. Before, the stage before
idled for them, and then ran its own alone while this one idled: a GPipe 2 x 8 step's trace shows
stage 0 waiting 9.7 ms for its last gradients and stage 1 idle for the 13 ms of stage 0's last ``B``.
The backward's timing ends with them (its span then covers the ``SEND_B``'s). A 1F1B list does so
only for a replica alone (its gradient path the plain one): with replicas, the data-parallel hooks
must see each parameter's last contribution while armed, so its held ``W`` s are added before the
last ``B``, which runs whole. Alone, every ``B`` of the list holds its ``W`` (the first and the last
too: nothing needs them apart).

Evaluation steps (``RunStep.source = "eval"``, a list without backwards). The first and last
stages read the held-out samples, and the last reports each microbatch's loss and, with a
metric, the sum of its per-sample values (``services.compute.stage.metric_sum``). The service
runs them inside :func:`evaluating`: the modules in eval mode, the RNG forked, so an evaluation
changes nothing training sees.

Loss weighting. With ``loss_reduction="mean"`` microbatch ``m`` of ``n_m`` samples
contributes ``loss_m * n_m / N`` (``N`` samples in the step), so the gradients equal
those of the mean loss over the whole batch, for uneven microbatches too; ``"sum"``
weighs each by 1. The request's ``loss_scale`` multiplies every weight (fp16's loss scale;
1 otherwise). Reported losses are unweighted and unscaled.

Precision. Under ``bf16`` or ``fp16`` each forward and its loss run under autocast, the
backwards outside it (see [Note: mixed precision] in ``services/compute/precision.py``).

Timings (``time.time()`` seconds, one per action): compute actions from the moment
their inputs are in hand to the end of the compute; receives from posting to the moment
their data was waited for; sends from posting to the first action boundary (or the end
of the step) at which they were seen complete.

Gradient path. With a :class:`~services.params.grad_path.GradientPath`, the executor arms it
just before the list's last backward (``B`` or ``I``) and finishes it after the sends (a collective path
then holds the gradients averaged over the stage's replicas); its timing is a phase of
the reply. See [Note: microbatches and the all-reduce] in ``services/params/grad_path.py``.

Tied parameters. With a :class:`~services.params.tied.TiedSync`, a step that trains then sums
the gradients of the parameters other stages hold too (after the gradient path: over the
replicas first); its timing is a ``tied_sync`` phase. See [Note: tied parameters] in
``services/params/tied.py``.

Random draws. With a :class:`~services.compute.randomness.ModelRandomness`, every forward (and
the loss) runs keyed by the step and the microbatch's sample indices, so dropout and any other
random op draw what one process draws for those samples (see [Note: randomness that survives
the cut] in ``services/compute/randomness/mode.py``).

Recompute. A stage built with ``ComputeOptions.recompute`` runs a training forward node by node,
each under ``torch.utils.checkpoint``; its recomputation in the backward replays the keyed draws
and the deferring layers' microbatch (see [Note: recompute per cell] in
``services/compute/recompute.py``).

Non-finite values. The reply names the parameters whose gradient (after the gradient path:
averaged over the replicas in collective mode; a tied one summed over its stages) holds a NaN
or Inf, as AMP's ``GradScaler`` checks; with the losses it reports, the coordinator decides
whether the step's update is applied (see [Note: a step that is not finite] in
``coordinator/runtime/nonfinite.py``).

Devices. The stage computes on ``stage.device``; its samples are loaded on the CPU and moved
there. Transfers go through the device the pipeline's backend moves (``comm.factory.wire_device``):
NCCL receives into and sends from device buffers directly; a zmq or gloo pipeline receives into
CPU buffers, copied to the device once they arrived, and sends copies on the CPU. The losses are
read back once, at the end of the step (one synchronisation of the device, not one per microbatch).

[Note: one NCCL communicator per direction]
NCCL runs the transfers between two ranks of a communicator one after the other, in the order
each rank issues them, and a send larger than NCCL's buffer waits for its receive. A 1F1B stage
sends the next microbatch's activations before it receives the gradients its neighbour sends
first, so on one communicator both sends would wait forever. Over NCCL, gradients therefore travel
on a communicator of their own (a second process group over the pipeline's ranks, made at the
first step): on each, one side only sends and the other only receives, in the same order. zmq and
gloo transfers do not wait on each other.

Every wait is bounded by the step's deadline; errors are raised as :class:`StepFailed`
naming the stage, the step and the action.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from comm.base import Communicator, Work
from comm.factory import wire_device
from services import faults
from services.compute.boundary import empty_buffers, flatten, transfer_tag, unflatten
from services.compute.precision import autocast, device_type
from services.compute.randomness import ModelRandomness, replaying
from services.compute.recompute import Replay, attribute_replay, recomputed_forward
from services.compute.stage import Stage, metric_sum, to_device
from services.compute.turns import StepTurns
from services.compute.weight_grads import (
    HOLD_SHARE,
    WeightGradStore,
    defers,
    in_place_backwards,
    weight_runs,
)
from services.params.clipping import tensor_norms
from services.params.grad_path import GradientPath
from services.params.tied import TiedSync
from services.protocol import (
    MAX_NONFINITE_NAMED,
    Action,
    ActionKind,
    PhaseTiming,
    Precision,
    RunStep,
    StepReply,
    pack_times,
)

__all__ = ["StepExecutor", "StepFailed", "check_grads", "evaluating"]

_FAULT_PHASES: dict[str, faults.Phase] = {"F": "forward", "B": "backward", "I": "backward"}

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
        precision: What the forwards compute in (``ComputeOptions.precision``).
        tied: The stage's parameters tied to other stages', if it holds any.
        randomness: Keys the forwards' random draws; None: they draw from torch's generators.
        turns: The step's turns when the worker holds other stages of the pipeline too: action ``k``
            waits for its turn in the worker's order and passes it on once run (``turns.py``).
    """

    def __init__(self, stage: Stage, comm: Communicator | None, request: RunStep,
                 trains: bool, deadline: float,
                 grad_path: GradientPath | None = None, precision: Precision = "fp32",
                 tied: TiedSync | None = None, randomness: ModelRandomness | None = None,
                 turns: StepTurns | None = None) -> None:
        self._turns = turns
        self._stage = stage
        self._autocast = (precision, device_type(p for _, p in stage.parameters()))
        self._randomness = randomness
        self._grad_path = grad_path
        self._tied = tied
        backwards = [k for k, a in enumerate(request.actions) if a.kind in ("B", "I")]
        self._last_backward = backwards[-1] if backwards else None
        # a backward split in I and W, or GPipe's B's: the stage's linear layers defer their weight gradients
        # (fp32/fp64; under autocast I runs the whole backward and W has nothing left to do)
        self._defers = deferring = defers(request.actions) and precision == "fp32"
        # any other list: the B's in between run I and their W, in place (none under autocast); every B, with
        # no gradient path (no hook waits for a parameter's last contribution: [Note: the last W after the
        # send])
        self._in_place: set[int] = set()
        self._alone = grad_path is None or type(grad_path) is GradientPath  # one replica: a hookless path
        if precision == "fp32" and not deferring:
            every = {a.microbatch for a in request.actions if a.kind == "B"}
            self._in_place = (every if self._alone and len(every) > 1
                              else in_place_backwards(request.actions, request.zero_grad))
        self._store = WeightGradStore.of(stage.module) if deferring or self._in_place else None
        # the B's (or a lone replica's W's) whose W waits to be computed with later ones', and the bytes they
        # may hold
        self._held: list[int] = []
        self._hold_limit = self._store.weight_bytes() // HOLD_SHARE if self._store is not None else 0
        # the last backward's microbatch whose SEND_B then runs the step's last W's (None: none waits)
        self._tail: int | None = None
        self._w_runs = weight_runs(request.actions)
        # recompute: what a node's recomputation must see as its forward did ([Note: recompute per cell])
        self._replays: list[Replay] = [replaying]
        if self._store is not None:
            self._replays.append(attribute_replay(self._store, "microbatch"))
        self._w_times: dict[int, tuple[float, float]] = {}  # a W the first of its run computed -> its share
        self._comm = comm  # activations (SEND_F, RECV_F)
        self._grad_comm = comm  # gradients (SEND_B, RECV_B): see run()
        self._request = request
        self._trains = trains
        self._deadline = deadline
        self._mbs = [_Microbatch(list(s)) for s in request.microbatches]
        total = sum(len(s) for s in request.microbatches)
        self._weights = [(len(s) / total if stage.loss_reduction == "mean" else 1.0) * request.loss_scale
                         for s in request.microbatches]
        self._starts = [0.0] * len(request.actions)
        self._ends: list[float | None] = [None] * len(request.actions)
        self._sends: list[tuple[int, Work, torch.Tensor]] = []
        self._losses: list[torch.Tensor | None] = [None] * len(self._mbs) if stage.last else []
        # where the pipeline's backend takes its tensors: the stage's device (NCCL) or the CPU (zmq, gloo)
        self._wire = wire_device(comm.backend, stage.device) if comm is not None else stage.device
        self._samples = stage.eval_samples if request.source == "eval" else stage.samples
        self._metrics = [0.0] * len(self._mbs) if request.source == "eval" and stage.metric_fn else []
        self._posted = False
        self._k = 0

    def run(self) -> StepReply:
        """Run every action in order, then wait for the sends.

        Raises:
            StepFailed: an action raised, a transfer failed or the deadline passed.
        """
        deferring = self._store.deferring() if self._store is not None else contextlib.nullcontext()
        with _current(self._stage.device), deferring:
            return self._run()

    def _run(self) -> StepReply:
        if self._request.zero_grad:
            for _, p in self._stage.parameters():
                p.grad = None
        if self._tied is not None and self._last_backward is not None:
            self._tied.begin(self._request.zero_grad)
        handlers = {"F": self._forward, "B": self._backward, "I": self._backward, "W": self._weight,
                    "SEND_F": self._send_act, "RECV_F": self._recv_act, "SEND_B": self._send_grad,
                    "RECV_B": self._recv_grad}
        action: Action | None = None
        phases: list[PhaseTiming] = []
        try:
            self._grad_comm = _gradient_channel(self._comm)
        except Exception as exc:
            raise StepFailed(f"stage {self._stage.index}, step {self._request.step}: making the pipeline's "
                             f"gradient communicator: {type(exc).__name__}: {exc}",
                             transfers_posted=False) from exc
        try:
            for k, action in enumerate(self._request.actions):
                self._k = k
                if action.microbatch == 0 and action.kind in _FAULT_PHASES:
                    faults.at(self._request.step, _FAULT_PHASES[action.kind])
                if self._turns is not None:
                    self._turns.wait(k)
                self._starts[k] = time.time()
                handlers[action.kind](self._mbs[action.microbatch], action)
                if action.kind in ("F", "B"):
                    self._ends[k] = time.time()
                if self._turns is not None:
                    self._turns.done(k)
                self._poll_sends()
            action = None
            if self._tail is not None:  # a list whose last backward's SEND_B never came (not a valid one)
                self._last_weights()
            for k, work, _ in self._sends:
                work.wait(self._left("the step's sends"))
                self._ends[k] = time.time()
            if self._grad_path is not None and self._last_backward is not None:
                faults.at(self._request.step, "sync")
                phase = self._grad_path.finish(self._left("the gradient synchronisation"))
                phases += [phase] if phase is not None else []
            if self._tied is not None and self._last_backward is not None:
                phases.append(self._tied.sync(self._left("summing the tied parameters' gradients")))
            nonfinite, sq_norm = self._check_grads() if self._last_backward is not None else ([], None)
            losses = _read_back(self._losses)
        except StepFailed:
            raise
        except Exception as exc:
            at = self._where() if action is not None else (
                f"stage {self._stage.index}, step {self._request.step}, waiting for the sends and the "
                "gradient synchronisation (replicas, tied parameters)")
            raise StepFailed(f"{at}: {type(exc).__name__}: {exc}", transfers_posted=self._posted) from exc
        ends = [e if e is not None else s for s, e in zip(self._starts, self._ends, strict=True)]
        return StepReply(step=self._request.step, stage=self._stage.index, losses=losses,
                         metric_sums=self._metrics, times=pack_times(self._starts, ends), phases=phases,
                         nonfinite_grads=nonfinite, grad_sq_norm=sq_norm)

    # -- plumbing ---------------------------------------------------------------------

    def _check_grads(self) -> tuple[list[str], float | None]:
        """The parameters whose gradient holds a NaN or Inf (the first ``MAX_NONFINITE_NAMED``), and the
        gradients' squared norm (None on a path whose gradients are not final: the parameter server's)."""
        params = self._stage.parameters()
        grads = (self._grad_path.held_grads(params) if self._grad_path is not None
                 else [(name, p.grad) for name, p in params if p.grad is not None])
        bad, sq_norm = check_grads(grads)
        if self._tied is not None and self._tied.mirrors:  # another stage owns them: counted there, once
            sq_norm = check_grads([(n, g) for n, g in grads if n not in self._tied.mirrors])[1]
        final = self._grad_path is None or self._grad_path.updates_locally
        return bad[:MAX_NONFINITE_NAMED], sq_norm if final else None

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
        comm = self._comm if action.kind == "RECV_F" else self._grad_comm
        assert comm is not None and action.peer is not None
        m = action.microbatch
        works = [comm.irecv(buf, action.peer, tag=transfer_tag(m, i)) for i, buf in buffers]
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
        return [(i, buf.to(self._stage.device)) for i, buf in buffers]  # from the CPU unless NCCL's

    def _post_sends(self, action: Action, tensors: list[tuple[int, torch.Tensor]]) -> None:
        comm = self._comm if action.kind == "SEND_F" else self._grad_comm
        assert comm is not None and action.peer is not None
        for i, t in tensors:
            t = t.detach().to(self._wire).contiguous()  # a CPU copy unless NCCL's
            work = comm.isend(t, action.peer, tag=transfer_tag(action.microbatch, i))
            self._sends.append((self._k, work, t))
            self._posted = True
        if not tensors:
            self._ends[self._k] = time.time()

    # -- the eight kinds of action ----------------------------------------------------

    def _recv_act(self, mb: _Microbatch, action: Action) -> None:
        assert self._stage.incoming is not None
        self._post_recvs(mb, action, empty_buffers(self._stage.incoming, len(mb.samples), device=self._wire))

    def _recv_grad(self, mb: _Microbatch, action: Action) -> None:
        assert self._stage.outgoing is not None
        self._post_recvs(mb, action, empty_buffers(self._stage.outgoing, len(mb.samples), grad_only=True,
                                                   device=self._wire))

    def _forward(self, mb: _Microbatch, action: Action) -> None:
        stage, m, grad = self._stage, action.microbatch, self._trains
        if stage.first or stage.last:
            assert self._samples is not None
            inputs, mb.targets = to_device(self._samples.load(mb.samples), stage.device)
        if not stage.first:
            assert stage.incoming is not None
            buffers = self._wait_recvs(mb, "RECV_F",
                                       f"microbatch {m}'s activations from stage {stage.index - 1}")
            for (_, buf), spec in zip(buffers, stage.incoming.tensors, strict=True):
                buf.requires_grad_(grad and spec.requires_grad)
            mb.inputs = [buf for _, buf in buffers]
            # the module gets copies of the leaves it differentiates ([Note: received values change in place])
            inputs = unflatten(stage.incoming, [t.clone() if t.requires_grad else t for t in mb.inputs])
        keyed = (self._randomness.forward(self._request.step, mb.samples) if self._randomness is not None
                 else contextlib.nullcontext())
        if self._store is not None:  # the linear layers queue this microbatch's (input, gradient) in I
            self._store.microbatch = m if not self._in_place or m in self._in_place else None
        with torch.set_grad_enabled(grad), autocast(*self._autocast), keyed:
            if stage.pieces is not None and grad:  # recompute: each node checkpointed
                out = recomputed_forward(stage.pieces, inputs, self._replays)
            else:
                out = stage.module(inputs)
            if stage.last:
                assert stage.loss_fn is not None
                loss = stage.loss_fn(out, mb.targets)
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise ValueError(f"the loss must be a one-element tensor, got {type(loss).__name__}"
                                     f"{list(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
                mb.loss = loss
                self._losses[m] = loss.detach().reshape(())
                if self._metrics:
                    assert stage.metric_fn is not None
                    self._metrics[m] = metric_sum(stage.metric_fn(out, mb.targets), len(mb.samples),
                                                  what="the metric")
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
        """``B``, or ``I``: the same backward with the deferred layers' weight gradients queued for ``W``."""
        stage, m = self._stage, action.microbatch
        what = f"microbatch {m}'s gradients from stage {stage.index + 1}"
        grads = [] if stage.last else self._wait_recvs(mb, "RECV_B", what)
        last = self._k == self._last_backward
        if last and m not in self._in_place:
            self._flush_held()  # the held W's add in place while the hooks are disarmed
            if self._grad_path is not None:
                self._grad_path.arm()  # the parameters' last contributions come now
        if stage.last:
            assert mb.loss is not None
            torch.autograd.backward([(mb.loss * self._weights[m]).reshape(())])
        else:
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
        if m in self._in_place:  # its W, in place, with those of the B's held before it
            assert self._store is not None
            self._held.append(m)
            if last:  # no gradient path: after the input gradients' send
                self._tail = m
            elif self._store.held_bytes() > self._hold_limit:
                self._flush_held()
        elif self._defers and action.kind == "B" and last:  # GPipe: every microbatch's W's, after the send
            self._tail = m
        if self._tail is not None and stage.first:  # no SEND_B to wait for
            self._last_weights()
        self._ends[self._k] = time.time()

    def _last_weights(self) -> None:
        """The step's last W's, which waited for the last backward's SEND_B ([Note: the last W after the
        send]), timed as part of that backward."""
        self._tail = None
        if self._defers:
            assert self._store is not None
            self._store.flush(None, final=True)  # GPipe: every microbatch's weight gradients at once
        else:
            self._flush_held()
        assert self._last_backward is not None
        self._ends[self._last_backward] = time.time()

    def _flush_held(self) -> None:
        """The held in-between B's W's, one product per layer, added into ``.grad`` in place."""
        if self._held:
            assert self._store is not None
            self._store.flush(self._held, check=False)
            self._held = []

    def _weight(self, mb: _Microbatch, action: Action) -> None:
        """``W``: the first ``W`` of a run of consecutive ones computes the run's microbatches at once (one
        product per layer, :meth:`WeightGradStore.flush`); after the list's last ``I``, every queued one
        (each parameter then gets its last contribution in one flush: see [Note: splitting a backward]).
        Each ``W`` of the run is timed as an equal share of it.

        A lone replica's ``W`` s (no hook waits for a parameter's last contribution) are held while the
        queued rows stay within 1/``HOLD_SHARE`` of the weights' bytes, and computed with a later run (timed
        as nothing); past it a run computes every queued microbatch ([Note: a backward's weight gradients in
        place] in ``services/compute/weight_grads.py``)."""
        k = self._k
        if k in self._w_times:  # computed by the first W of its run
            self._starts[k], self._ends[k] = self._w_times.pop(k)
            return
        run = self._w_runs[k]
        assert self._last_backward is not None  # a list with W's has I's
        if (self._store is not None and self._alone and k < self._last_backward
                and self._store.held_bytes() <= self._hold_limit):  # held for a later W (see below)
            now = time.time()
            for j in run:
                self._w_times[j] = (now, now)
            self._starts[k], self._ends[k] = self._w_times.pop(k)
            return
        if self._store is not None:
            if k > self._last_backward:  # the deferred parameters' last contribution: their hooks fire
                self._store.flush(None, final=True)
            else:
                self._store.flush(None if self._alone else [self._request.actions[j].microbatch for j in run])
        start, share = self._starts[k], (time.time() - self._starts[k]) / len(run)
        for n, j in enumerate(run):
            self._w_times[j] = (start + n * share, start + (n + 1) * share)
        self._starts[k], self._ends[k] = self._w_times.pop(k)

    def _send_grad(self, mb: _Microbatch, action: Action) -> None:
        self._post_sends(action, mb.input_grads)
        mb.input_grads = []
        if self._tail == action.microbatch:
            self._poll_sends()  # the send's own time ends here, not after the W's
            self._last_weights()


_GRADIENT_CHANNELS: weakref.WeakKeyDictionary[Communicator, Communicator] = weakref.WeakKeyDictionary()


def _gradient_channel(comm: Communicator | None) -> Communicator | None:
    """The communicator a pipeline's gradients travel on: ``comm`` itself, or over NCCL one of their own,
    made once per pipeline communicator by every stage at its first step ([Note: one NCCL communicator per
    direction])."""
    if comm is None or comm.backend != "nccl":
        return comm
    channel = _GRADIENT_CHANNELS.get(comm)
    if channel is None:
        channel = comm.new_group(range(comm.world_size))
        assert channel is not None  # every rank is a member
        _GRADIENT_CHANNELS[comm] = channel
    return channel


def _current(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Make a CUDA ``device`` the step thread's current one (what allocations and NCCL calls default to)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _read_back(losses: list[torch.Tensor | None]) -> list[float]:
    """The losses as numbers, read from their device at once (a microbatch without a forward: 0)."""
    present = [t.to(torch.float64) for t in losses if t is not None]
    values = iter(torch.stack(present).tolist() if present else [])
    return [next(values) if t is not None else 0.0 for t in losses]


@contextmanager
def evaluating(module: torch.nn.Module) -> Iterator[None]:
    """Inside, every submodule of ``module`` is in eval mode and the CPU RNG is forked; on the way out
    each submodule's own mode (a frozen BatchNorm's eval included) and the RNG state are as before."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        for m, training in modes:
            m.training = training


def check_grads(named: list[tuple[str, torch.Tensor]]) -> tuple[list[str], float]:
    """The names of the tensors that hold a NaN or an Inf, in order, and the sum of the tensors' squared
    L2 norms (for clipping by the global norm: ``services/params/clipping.py``).

    One read of the tensors gives both (the per-tensor norms: ~1 ms for 34 MB here, as a sum
    would; ``isfinite(g).all()`` allocates a mask per tensor: ~20 ms): a norm is NaN or Inf
    exactly when its tensor holds one (:func:`~services.params.clipping.tensor_norms` computes
    a finite tensor's overflowing norm again in float64), so the answer is exact.
    """
    norms = tensor_norms([t for _, t in named])
    bad = [name for (name, _), ok in zip(named, norms.isfinite().tolist(), strict=True) if not ok]
    return bad, float((norms * norms).sum())
