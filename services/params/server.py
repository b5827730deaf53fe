"""The push/pull parameter service: one shard of the parameters, their optimizer, versions and clocks.

Lifecycle. A worker builds the shard empty (:meth:`ParamServerService.from_assignment`);
one ``setup`` RPC (:class:`~services.protocol.ShardSetup` plus the initial values as
tensors) gives it its parameters, mode, replica count and optimizer; a second ``setup``
is refused (``already_setup``). ``pull``/``push`` before setup are refused (``not_ready``).
``info`` tells what the shard holds. Tensors travel as pieces (:mod:`services.params.sharding`).

Words, exactly:

* **version** -- the number of updates this shard has completed (0 after setup): in sync
  mode the steps closed, in async mode the pushes applied in full.
* **step** -- a replica's own iteration number, sent with every push (0, 1, 2, ...).
* **clock** of replica r -- ``1 + the last step of r that was applied`` (0 before any).
* **ahead** -- replica r is ``clock[r] - min(clock)`` steps ahead of the slowest replica.

Synchronous mode (``sync``). The open step is ``version``. Each replica pushes once for
it; when all ``replicas`` have pushed, the shard divides the summed gradients by
``replicas`` (a parameter a replica sent no gradient for counts as zero from it; one
nobody sent is skipped by the optimizer), takes one optimizer step and opens the next
step (``version += 1``). A push is answered at once (its ``version`` may predate the
update); a pull with ``min_version = v`` waits until the shard reached version ``v``.
Pushes for a step below ``version`` are refused with ``step_closed``, above it with
``step_ahead`` (pull that version first). A parameter whose gradients from every replica
are in is stepped at once, while the rest of the push is still on the wire (see
:meth:`~services.params.store.ParamStore.step`); pulls wait until the whole step is done,
so nobody sees a half-updated version.

Held rounds (sync, ``ShardSetup.hold_rounds``: clipping by the global norm). Nothing is stepped
while the pushes arrive: once the round is complete the shard divides the sums by ``replicas``
and waits. ``round_norm`` (:class:`~services.protocol.RoundNormRequest`, deferred until the round
is complete) answers the squared norm of the averaged gradient; ``apply_round``
(:class:`~services.protocol.ApplyRound`) multiplies it by the coordinator's coefficient, steps the
optimizer and opens the next step, which releases the pulls. Both are the coordinator's, who
adds every shard's norm first (``coordinator/runtime/shards.py``).

Learning-rate scheduler (sync; ``OptimizerSpec.scheduler``). Brought to the training step of the
round (``PushRequest.train_step`` of its first part; ``ApplyRound.train_step`` when held) before
the round's first update, and stepped once the round is applied: see [Note: a scheduler's
position] in ``services/params/scheduling.py``.

Asynchronous mode (``async``). Each push is applied on arrival: one optimizer step with
that push's gradient alone (``version += 1``), and the pusher's clock becomes
``step + 1`` (steps may be skipped, never revisited: ``step < clock`` is ``step_closed``).
The staleness bound S is enforced on pulls: a pull by replica r waits until
``clock[r] - min(clock) <= S`` (and ``version >= min_version``). A replica that pulls
before each step therefore never computes a step more than S steps ahead of the slowest
replica's last applied one. S = 0 runs the replicas in lockstep rounds; within a round
gradients are still applied one by one (``sync`` averages them instead).

Parts. One push may travel as several messages (``part`` of ``parts``, each a disjoint
set of whole parameters), so the shard accumulates early parts while later ones are still
on the wire; a push counts once all its parts arrived. In async mode each part is applied
on arrival, so a pull may observe a multi-part push partly applied (``version`` counts
complete pushes only).

Idempotence. Every push part carries ``(replica, step, seq, part)``; the shard remembers
the parts of the last :data:`REMEMBERED_PUSHES` pushes it accepted per replica, and a part
matching one of them is answered ``duplicate=True`` without touching anything, even after
its step closed. A second, different push (another ``seq``) for a step while the
replica's push is open is refused (``bad_request``).

Checkpoints (sync mode; :mod:`services.params.shard_state` for what a part holds). A
``save`` (:class:`~services.protocol.ShardSave`, the coordinator's only) names a version: the
shard copies its optimizer state to host memory the moment it reaches that version (at once
if it is there, between two updates), writes it in the background and answers with the
:class:`~services.protocol.SavedPart` once it is written (its ``error`` if the write failed).
A save for a version the shard already went past is refused (``step_closed``): its state is
gone, and the coordinator drops that checkpoint. A ``setup`` with ``restore`` loads the
parameters' optimizer state from that checkpoint before the shard answers.

Errors (:class:`~comm.rpc.framing.RpcError` codes): ``not_ready``, ``already_setup``,
``bad_request`` (malformed pieces, replica out of range, setup that does not fit, a
checkpoint to restore that lacks or misshapes a tensor, a save in async mode),
``not_owner`` (names the parameter and this shard), ``step_closed``, ``step_ahead``,
``timeout`` (a pull's, a save's or a round norm's wait ran out; names what it waited for).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch

from comm.rpc import Call, RpcError, ServiceBase, callable_by
from services import faults
from services.checkpoint.dcp import CheckpointFormatError
from services.checkpoint.stage_state import Snapshot
from services.checkpoint.writer import PartWriter
from services.params import shard_state
from services.params.store import NotOwnedError, ParamStore
from services.protocol import (
    ApplyRound,
    Assignment,
    Empty,
    PullReply,
    PullRequest,
    PushReply,
    PushRequest,
    RoundNorm,
    RoundNormRequest,
    ShardInfo,
    ShardSave,
    ShardSetup,
)

__all__ = ["REMEMBERED_PUSHES", "ParamServerService"]

log = logging.getLogger(__name__)

REMEMBERED_PUSHES = 16  # accepted (step, seq) kept per replica to recognise re-sent pushes


@dataclass
class _Push:
    """One replica's push whose parts are (or were, until its step closed) arriving."""

    step: int
    seq: int
    parts: int
    got: set[int] = field(default_factory=set)

    @property
    def complete(self) -> bool:
        return len(self.got) == self.parts


@dataclass
class _Shard:
    setup: ShardSetup
    store: ParamStore
    version: int = 0
    clocks: list[int] = field(default_factory=list)
    pushes: dict[int, _Push] = field(default_factory=dict)  # replica -> its open push
    # replica -> (step, seq) -> parts accepted, for the last REMEMBERED_PUSHES pushes
    accepted: dict[int, OrderedDict[tuple[int, int], set[int]]] = field(default_factory=dict)
    waiting: list[tuple[PullRequest, Call]] = field(default_factory=list)  # deferred pulls
    saves: list[tuple[ShardSave, Call]] = field(default_factory=list)  # waiting for their version
    held: float | None = None  # hold_rounds: the complete round's squared norm, until it is applied
    norms: list[tuple[RoundNormRequest, Call]] = field(default_factory=list)  # waiting for the round


def _before_write(snap: Snapshot) -> None:
    faults.at(snap.step, "save")


class ParamServerService(ServiceBase):
    """One parameter shard (see the module docstring for the contract).

    Args:
        name: the service's name on its worker; errors name the shard by it.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._shard: _Shard | None = None
        self._writer = PartWriter(before_write=_before_write)

    @classmethod
    def from_assignment(cls, assignment: Assignment) -> ParamServerService:
        """An empty shard named ``assignment.service``; ``setup`` gives it its parameters.

        Raises:
            ValueError: ``assignment.options`` is not empty (the shard takes none).
        """
        if assignment.options:
            raise ValueError(f"param_server takes no options (send a setup RPC); got "
                             f"{sorted(assignment.options)}")
        return cls(assignment.service)

    # -- RPCs ------------------------------------------------------------------------

    @callable_by("worker", "coordinator")
    def rpc_setup(self, request: ShardSetup, call: Call) -> ShardInfo:
        if self._shard is not None:
            raise RpcError("already_setup", f"shard {self.name!r} is already set up (version "
                                            f"{self._shard.version}); build a new service for a new job")
        if request.mode == "sync" and request.staleness:
            raise RpcError("bad_request", "staleness applies to async mode only")
        if request.mode == "async" and (request.hold_rounds or request.optimizer.scheduler is not None):
            raise RpcError("bad_request", "held rounds and learning-rate schedulers need sync mode: an async "
                                          "update belongs to no one training step")
        unknown = sorted(set(request.keys) - {p.name for p in request.params})
        if unknown:
            raise RpcError("bad_request", f"setup of shard {self.name!r}: checkpoint keys for parameters "
                                          f"it does not hold: {unknown[:8]}")
        try:
            store = ParamStore(list(request.params), call.tensors, request.optimizer)
            restored = (shard_state.restore(store, Path(request.restore), request.keys)
                        if request.restore else 0)
        except CheckpointFormatError as exc:
            raise RpcError("bad_request", f"setup of shard {self.name!r}: restoring: {exc}") from None
        except ValueError as exc:
            raise RpcError("bad_request", f"setup of shard {self.name!r}: {exc}") from None
        self._shard = _Shard(setup=request, store=store, clocks=[0] * request.replicas,
                             accepted={r: OrderedDict() for r in range(request.replicas)})
        log.info("shard %s: %d parameters, %s mode, %d replicas, %s%s", self.name, len(store.names),
                 request.mode, request.replicas, request.optimizer.name,
                 f", optimizer state of {restored} restored from {request.restore}" if restored else "")
        return self._info()

    @callable_by("worker", "coordinator")
    def rpc_info(self, request: Empty, call: Call) -> ShardInfo:
        return self._info()

    @callable_by("worker", "coordinator")
    def rpc_pull(self, request: PullRequest, call: Call) -> PullReply | None:
        shard = self._ready()
        self._check_replica(shard, request.replica)
        unknown = [n for n in request.params if n not in shard.store]
        if unknown:
            raise RpcError("not_owner", f"shard {self.name!r} does not hold parameters {unknown}")
        if self._may_pull(shard, request):
            call.tensors_out = self._values(shard, request)
            return self._pull_reply(shard)
        shard.waiting.append((request, call))

        def on_timeout() -> tuple[str, str]:
            shard.waiting[:] = [(r, c) for r, c in shard.waiting if c is not call]
            return "timeout", self._why_waiting(shard, request)

        call.defer(timedelta(milliseconds=request.timeout_ms), on_timeout)
        return None

    def rpc_save(self, request: ShardSave, call: Call) -> None:
        shard = self._ready()
        if shard.setup.mode != "sync":
            raise RpcError("bad_request", f"shard {self.name!r} runs async: its state at a version is no "
                                          "step's state, so it cannot be checkpointed (use sync mode)")
        if shard.version > request.version or (shard.version == request.version and shard.store.mid_round):
            raise RpcError("step_closed", f"shard {self.name!r} is already past version {request.version} "
                                          f"(at {shard.version}): the optimizer state of checkpoint step "
                                          f"{request.save.step} is gone; the save must arrive before the "
                                          "next update")

        def on_timeout() -> tuple[str, str]:
            waiting = any(c is call for _, c in shard.saves)
            shard.saves[:] = [(r, c) for r, c in shard.saves if c is not call]
            what = (f"for version {request.version} (at {shard.version})" if waiting
                    else "for its part to be written")
            return "timeout", (f"save of checkpoint step {request.save.step} at shard {self.name!r} waited "
                               f"{request.timeout_ms / 1000:.1f}s {what}")

        call.defer(timedelta(milliseconds=request.timeout_ms), on_timeout)
        shard.saves.append((request, call))
        self._save_due(shard)

    @callable_by("worker", "coordinator")
    def rpc_push(self, request: PushRequest, call: Call) -> PushReply:
        shard = self._ready()
        r, key = request.replica, (request.step, request.seq)
        self._check_replica(shard, r)
        try:
            grads = shard.store.parse(call.tensors)
        except NotOwnedError as exc:
            raise RpcError("not_owner", f"shard {self.name!r} does not hold parameter"
                                        f"{'s' if len(exc.names) > 1 else ''} {exc.names}; "
                                        "push each gradient to the shard that owns it") from None
        except ValueError as exc:
            raise RpcError("bad_request", f"push to shard {self.name!r}: {exc}") from None
        if request.part in shard.accepted[r].get(key, ()):
            return PushReply(version=shard.version, duplicate=True)
        push = shard.pushes.get(r)
        if shard.setup.mode == "sync":
            self._check_sync(shard, request, push)
        else:
            self._check_async(shard, request, push)
        hold = shard.setup.hold_rounds
        if shard.setup.mode == "sync" and not shard.pushes and request.train_step is not None and not hold:
            self._advance(shard, request.train_step)  # the round's first part: before any update
        if push is None:
            push = shard.pushes[r] = _Push(request.step, request.seq, request.parts)
        replicas = shard.setup.replicas if shard.setup.mode == "sync" else 1
        # a parameter every replica has sent its gradient for is stepped now, while later parts
        # are still on the wire (sync: pulls wait until the round is finished, see _may_pull)
        complete = shard.store.accumulate(grads, complete_at=replicas)
        if not hold:
            shard.store.step(complete, divisor=replicas)
        push.got.add(request.part)
        accepted = shard.accepted[r]
        accepted.setdefault(key, set()).add(request.part)
        accepted.move_to_end(key)
        while len(accepted) > REMEMBERED_PUSHES:
            accepted.popitem(last=False)
        if shard.setup.mode == "sync":
            pushes = shard.pushes.values()
            applied = len(pushes) == shard.setup.replicas and all(p.complete for p in pushes)
            if applied and hold:
                shard.held = shard.store.average(shard.setup.replicas)
                self._answer_norms(shard)
                applied = False
            elif applied:
                shard.store.finish_round(divisor=shard.setup.replicas)
                self._close_round(shard)
        else:
            shard.store.finish_round(divisor=1)  # this part was applied alone, above
            applied = push.complete
            if applied:
                del shard.pushes[r]
                shard.version += 1
                shard.clocks[r] = request.step + 1
        if applied:
            self._release(shard)
        return PushReply(version=shard.version)

    def rpc_round_norm(self, request: RoundNormRequest, call: Call) -> RoundNorm | None:
        shard = self._held_round(request.version, "round_norm")
        if shard.held is not None:
            return RoundNorm(version=shard.version, sq_norm=shard.held)
        shard.norms.append((request, call))

        def on_timeout() -> tuple[str, str]:
            shard.norms[:] = [(r, c) for r, c in shard.norms if c is not call]
            done = {r for r, p in shard.pushes.items() if p.complete}
            missing = [r for r in range(shard.setup.replicas) if r not in done]
            return "timeout", (f"round_norm of step {request.version} at shard {self.name!r} waited "
                               f"{request.timeout_ms / 1000:.1f}s for pushes from replicas {missing}")

        call.defer(timedelta(milliseconds=request.timeout_ms), on_timeout)
        return None

    def rpc_apply_round(self, request: ApplyRound, call: Call) -> Empty:
        shard = self._held_round(request.version, "apply_round")
        if shard.held is None:
            raise RpcError("bad_request", f"shard {self.name!r}: step {request.version} is not complete yet; "
                                          "ask round_norm first and apply once every shard answered")
        self._advance(shard, request.train_step)
        shard.store.scale(request.grad_scale)
        shard.store.finish_round(divisor=1)  # averaged when the round was complete
        shard.held = None
        self._close_round(shard)
        self._release(shard)
        return Empty()

    # -- helpers ---------------------------------------------------------------------

    def _held_round(self, version: int, what: str) -> _Shard:
        """The shard, if it holds its rounds and ``version`` is its open step.

        Raises:
            RpcError: ``bad_request`` (rounds not held), ``step_closed`` or ``step_ahead``.
        """
        shard = self._ready()
        if not shard.setup.hold_rounds:
            raise RpcError("bad_request", f"{what}: shard {self.name!r} applies its rounds itself (set up "
                                          "without hold_rounds)")
        if version != shard.version:
            code = "step_closed" if version < shard.version else "step_ahead"
            raise RpcError(code, f"{what} of step {version}: shard {self.name!r} is at step {shard.version}")
        return shard

    def _answer_norms(self, shard: _Shard) -> None:
        assert shard.held is not None
        for _, call in shard.norms:
            if not call.answered:
                call.reply(RoundNorm(version=shard.version, sq_norm=shard.held))
        shard.norms.clear()

    def _advance(self, shard: _Shard, train_step: int) -> None:
        try:
            shard.store.advance(train_step)
        except ValueError as exc:
            raise RpcError("bad_request", f"shard {self.name!r}: {exc}") from None

    def _close_round(self, shard: _Shard) -> None:
        """A sync round is applied: open the next step, take the saves due, step the scheduler.

        Raises:
            RpcError: ``bad_request`` if the scheduler cannot step (the update is applied all the same).
        """
        shard.pushes.clear()
        shard.version += 1
        shard.clocks = [shard.version] * shard.setup.replicas
        self._save_due(shard)
        try:
            shard.store.step_scheduler()
        except ValueError as exc:
            raise RpcError("bad_request", f"shard {self.name!r}: {exc}") from None

    def _check_sync(self, shard: _Shard, request: PushRequest, push: _Push | None) -> None:
        """Refuse a sync push part that does not belong to the open step or to r's open push."""
        r, step, open_step = request.replica, request.step, shard.version
        if step < open_step:
            raise RpcError("step_closed", f"shard {self.name!r}: step {step} is closed (version {open_step}: "
                                          f"steps 0..{open_step - 1} applied); push from replica {r} "
                                          f"(seq {request.seq}) refused")
        if step > open_step:
            raise RpcError("step_ahead", f"shard {self.name!r}: step {step} is not open yet (open step: "
                                         f"{open_step}); replica {r} should pull version {step} first")
        if push is not None and push.seq != request.seq:
            raise RpcError("bad_request", f"shard {self.name!r}: replica {r} already pushed step {step} "
                                          f"with seq {push.seq}; seq {request.seq} is a second push")
        self._check_parts(request, push)

    def _check_async(self, shard: _Shard, request: PushRequest, push: _Push | None) -> None:
        """Refuse an async push part for a closed step, or one that interleaves r's open push."""
        r = request.replica
        if push is not None and (push.step, push.seq) != (request.step, request.seq):
            missing = sorted(set(range(push.parts)) - push.got)
            raise RpcError("bad_request", f"shard {self.name!r}: replica {r}'s push of step {push.step} "
                                          f"(seq {push.seq}) still lacks parts {missing[:8]}")
        if push is None and request.step < shard.clocks[r]:
            raise RpcError("step_closed", f"shard {self.name!r}: replica {r} already had step "
                                          f"{shard.clocks[r] - 1} applied; its push for step {request.step} "
                                          f"(seq {request.seq}) is too late")
        self._check_parts(request, push)

    def _check_parts(self, request: PushRequest, push: _Push | None) -> None:
        if push is not None and push.parts != request.parts:
            raise RpcError("bad_request", f"shard {self.name!r}: replica {request.replica}'s push (seq "
                                          f"{request.seq}) came in {push.parts} parts; this part says "
                                          f"{request.parts}")

    def _ready(self) -> _Shard:
        if self._shard is None:
            raise RpcError("not_ready", f"shard {self.name!r} has no parameters yet: send setup first")
        return self._shard

    def _check_replica(self, shard: _Shard, replica: int) -> None:
        if replica >= shard.setup.replicas:
            raise RpcError("bad_request", f"replica {replica} out of range: shard {self.name!r} serves "
                                          f"replicas 0..{shard.setup.replicas - 1}")

    def _may_pull(self, shard: _Shard, request: PullRequest) -> bool:
        if shard.version < request.min_version:
            return False
        if shard.setup.mode == "sync":
            return not shard.store.mid_round
        return shard.clocks[request.replica] - min(shard.clocks) <= shard.setup.staleness

    def _save_due(self, shard: _Shard) -> None:
        """Snapshot for every save waiting for the shard's current version; written in the background."""
        due = [(r, c) for r, c in shard.saves if r.version == shard.version]
        shard.saves[:] = [(r, c) for r, c in shard.saves if r.version != shard.version]
        for request, call in due:
            snap = shard_state.snapshot(shard.store, shard.setup.keys, request.save.step, request.part)
            self._writer.submit(snap, Path(request.save.directory), then=call.reply)

    def on_close(self) -> None:
        self._writer.close()

    def _release(self, shard: _Shard) -> None:
        still: list[tuple[PullRequest, Call]] = []
        for request, call in shard.waiting:
            if call.answered:
                continue
            if self._may_pull(shard, request):
                call.reply(self._pull_reply(shard), self._values(shard, request))
            else:
                still.append((request, call))
        shard.waiting[:] = still

    def _values(self, shard: _Shard, request: PullRequest) -> list[tuple[str, torch.Tensor]]:
        return shard.store.pieces(dict.fromkeys(request.params or shard.store.names))

    def _pull_reply(self, shard: _Shard) -> PullReply:
        return PullReply(version=shard.version, clocks=list(shard.clocks))

    def _why_waiting(self, shard: _Shard, request: PullRequest) -> str:
        waited = (f"pull by replica {request.replica} at shard {self.name!r} waited "
                  f"{request.timeout_ms / 1000:.1f}s")
        if shard.setup.mode == "sync":
            done = {r for r, p in shard.pushes.items() if p.complete}
            missing = [r for r in range(shard.setup.replicas) if r not in done]
            wanted = max(request.min_version, shard.version + 1 if shard.store.mid_round else 0)
            return (f"{waited} for version {wanted}; the shard is at version {shard.version}, step "
                    f"{shard.version} still lacks pushes from replicas {missing}")
        if shard.version < request.min_version:
            return f"{waited} for version {request.min_version}; the shard is at version {shard.version}"
        clocks = shard.clocks
        slowest = [r for r, c in enumerate(clocks) if c == min(clocks)]
        return (f"{waited} for the slowest replicas {slowest} (clock {min(clocks)}) to come within "
                f"staleness {shard.setup.staleness} of its clock {clocks[request.replica]}")

    def _info(self) -> ShardInfo:
        if self._shard is None:
            return ShardInfo(service=self.name, ready=False)
        s = self._shard
        return ShardInfo(service=self.name, ready=True, mode=s.setup.mode, replicas=s.setup.replicas,
                         staleness=s.setup.staleness, optimizer=s.setup.optimizer.name, version=s.version,
                         clocks=list(s.clocks), params=s.store.infos(),
                         moved=s.store.moves)
