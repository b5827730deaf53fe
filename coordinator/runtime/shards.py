"""The parameter shards of one runtime (parameter-server mode): placed, set up, restored and saved.

Stage ``s``'s parameters are spread over the workers of its data-parallel group
(``plan.dp_groups[s]``, never more shards than parameters), served as ``{run}/ps-s{s}-{i}``
and set up from the coordinator's copy of the model before any stage is placed: the
factory's values, or a checkpoint's when the run is restored, and then the shards also load
their parameters' optimizer state from that checkpoint's ``train/`` (by name:
``services/params/shard_state.py``). The driver (``coordinator/runtime/driver.py``) sends
the messages this module builds and routes their replies.

[Note: a shard's part of a checkpoint]
In this mode the optimizer runs in the shards, so a checkpoint must hold their state as of
the update the stages snapshot after (see [Note: how a checkpoint is taken] in
``coordinator/runtime/checkpoints.py``). The coordinator sends each shard a
:class:`~services.protocol.ShardSave` for version ``c + 1`` together with the requests that
carry commit ``c`` (and the stages' ``save``): a shard takes its snapshot the moment it has
applied that update, or at once if it already has. It cannot have gone further: the next
update needs every replica's next push, which only the next commit starts, and the
coordinator sends that only once every stage answered this step, so at least one round trip
after the save left. Should a save still arrive late (a message held up that long), the
shard refuses it and the checkpoint is dropped with a warning, never published with another
update's state. Each shard writes part ``ps-s{s}-{i}`` (``train/`` only: the stages' replica
0 write the values, which they pulled from the shards at that version) and answers the save
once the part is written; the driver hands that answer to the checkpointer with the next
step's parts, and ``flush_saves`` waits for every answer still due.

Asynchronous plans (``plan.staleness > 0``) set the shards up in ``async`` mode with that bound (see
[Note: replicas at their own pace] in ``coordinator/runtime/async_steps.py``); :meth:`ParamShards.values`
reads the final parameters from them.

[Note: a held round]
Clipping by the global norm (``optimizer.clip_grad_norm``) needs the norm of the averaged
gradient over every shard of every stage before any shard steps. So the shards are set up to
hold their rounds (``ShardSetup.hold_rounds``), and with every commit ``c`` the coordinator
asks each shard for its round's squared norm (``round_norm``, answered once every replica
pushed); when all have answered it adds them, computes torch's coefficient
(``services/params/clipping.py``) and sends each shard ``apply_round``, which steps it and
releases the stages' pulls. The driver waits for these answers as for the stages' (a refusal
fails the step, naming the shard). This costs one coordinator round trip per step, after the
pushes; the alternative, pushing at the end of the step so the push replies could carry the
norms, would need every skipped step's pushes undone at the shards.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta

import torch

from comm.wire import DTYPES
from coordinator.planning.plan import Plan
from coordinator.runtime.loop import EventLoop, Reply
from coordinator.runtime.records import _Service
from services.params.client import PushPullClient, ShardRef, setup_shards
from services.params.clipping import clip_coefficient
from services.protocol import (
    ApplyRound,
    Assignment,
    CommitStep,
    Empty,
    OptimizerSpec,
    RoundNorm,
    RoundNormRequest,
    SavedPart,
    SaveRequest,
    ShardAddress,
    ShardSave,
)

__all__ = ["WRITE_TIMEOUT", "ParamShards"]

WRITE_TIMEOUT = timedelta(seconds=600)  # a shard's part being written, past the step that reaches it


class ParamShards:
    """The shards of one runtime's plan (see the module docstring).

    Args:
        plan: The plan (its data-parallel groups host the shards).
        run: The runtime's run id (the services' prefix).
        addresses: Each placed worker's service-host address.
        initial_params: Starting values of every parameter by the stages' names (empty in collective
            mode: then there are no shards, and every method has nothing to do).
        holders: Each parameter's nodes (``Chain.holders``): a stage's shards serve those its first
            holding node lies in (a parameter tied across stages is served once, by its owner's shards:
            [Note: tied parameters] in ``services/params/tied.py``).
        clip_grad_norm: Clip the gradients to this global norm: the shards hold their rounds (see
            [Note: a held round]).

    Attributes:
        rounds: The held round's requests not answered yet (by request id).
        refused: A refused ``round_norm`` or ``apply_round`` (the driver fails the step with it).
    """

    def __init__(self, plan: Plan, run: str, addresses: Mapping[str, str],
                 initial_params: Mapping[str, torch.Tensor], holders: Mapping[str, tuple[int, ...]], *,
                 clip_grad_norm: float | None = None) -> None:
        self.plan = plan
        self.clip_grad_norm = clip_grad_norm
        self.services: list[_Service] = []
        self.saving: dict[int, tuple[_Service, ShardSave]] = {}  # the saves not answered yet, by request id
        self._saved: list[SavedPart] = []  # their answers, not reported yet
        self.rounds: dict[int, _Service] = {}
        self.refused: Reply | None = None
        self._norms: list[float] = []  # the held round's norms in so far
        self._round: CommitStep | None = None  # the commit whose round is held
        self._stages: list[tuple[list[ShardRef], dict[str, torch.Tensor]]] = []
        for s, st in enumerate(plan.stages):
            params = {n: t for n, t in initial_params.items()
                      if st.start <= holders.get(n, (-1,))[0] < st.stop}  # its first holder's stage
            group = plan.dp_groups[s][:len(params)]
            refs = [ShardRef(addresses[w], f"{run}/ps-s{s}-{i}") for i, w in enumerate(group)]
            self.services += [_Service(w, ref.service, -1, s) for w, ref in zip(group, refs, strict=True)]
            self._stages.append((refs, params))

    def assignments(self) -> list[tuple[_Service, Assignment]]:
        """What to assign each shard's worker (a ``param_server``, empty until :meth:`set_up`)."""
        return [(sv, Assignment(service=sv.name, kind="param_server")) for sv in self.services]

    def set_up(self, optimizer: OptimizerSpec, state_keys: Mapping[str, list[str]], restore: str,
               timeout: timedelta) -> list[str]:
        """Set every assigned shard up (stage by stage), restored from ``restore`` ("": fresh); one line
        per stage for the log. The coordinator's copy of the values is dropped.

        Raises:
            RpcError: A shard refused (a checkpoint it cannot restore from names the tensor).
            TimeoutError: A shard did not answer within ``timeout``.
        """
        lines = []
        for s, (refs, params) in enumerate(self._stages):
            if refs:
                keys = {n: state_keys[n][0] for n in params if state_keys.get(n)}
                setup_shards(refs, params, mode="async" if self.plan.staleness else "sync",
                             replicas=self.plan.data_parallel, optimizer=optimizer,
                             staleness=self.plan.staleness,
                             timeout=timeout, keys=keys, restore=restore,
                             hold_rounds=self.clip_grad_norm is not None)
                lines.append(f"stage {s}: {len(params)} parameters on {len(refs)} shards"
                             + (" (optimizer state restored)" if restore else ""))
        self._stages = [(refs, {}) for refs, _ in self._stages]
        return lines

    def values(self, timeout: timedelta) -> dict[str, torch.Tensor]:
        """Every shard's current parameter values, by the stages' names (pulled as replica 0: call once
        every replica pushed its last step, so the bound keeps no pull waiting).

        Raises:
            RpcError: A shard refused or its pull's wait ran out.
            TimeoutError: A shard did not answer within ``timeout``.
        """
        out: dict[str, torch.Tensor] = {}
        for refs, _ in self._stages:
            if not refs:
                continue
            with PushPullClient(refs, 0, timeout=timeout, retries=0) as client:
                into = {n: torch.empty(p.shape, dtype=DTYPES[p.dtype]) for n, p in client.params.items()}
                client.pull(into, timeout=timeout)
            out.update(into)
        return out

    @property
    def addresses(self) -> list[list[ShardAddress]]:
        """Per stage, its shards as the stages' options name them."""
        return [[ShardAddress(address=r.address, service=r.service) for r in refs]
                for refs, _ in self._stages]

    @staticmethod
    def part(sv: _Service) -> str:
        """The checkpoint part shard ``sv`` writes: ``ps-s{stage}-{i}``."""
        return sv.name.rsplit("/", 1)[-1]

    @property
    def parts(self) -> list[str]:
        """Every shard's checkpoint part (training state only: no model tensors)."""
        return [self.part(sv) for sv in self.services]

    def send_saves(self, loop: EventLoop, save: SaveRequest, version: int, step_timeout: timedelta) -> None:
        """Send each shard its save of checkpoint ``save`` at ``version`` (the update the carrying commit
        applies), bounded by ``step_timeout`` (reaching the version) plus :data:`WRITE_TIMEOUT`."""
        timeout_ms = int((step_timeout + WRITE_TIMEOUT).total_seconds() * 1000)
        for sv in self.services:
            request = ShardSave(save=save, version=version, part=self.part(sv), timeout_ms=timeout_ms)
            self.saving[loop.send(sv.worker, sv.name, "save", request, SavedPart)] = sv, request

    def send_round(self, loop: EventLoop, commit: CommitStep, save: SaveRequest | None,
                   step_timeout: timedelta) -> None:
        """What goes to the shards with ``commit``: the saves of ``save`` (see [Note: a shard's part of a
        checkpoint]), and with clipping the held round's norm requests (see [Note: a held round])."""
        if save is not None:
            self.send_saves(loop, save, commit.step + 1, step_timeout)
        if self.clip_grad_norm is None or not self.services:
            return
        request = RoundNormRequest(version=commit.step, timeout_ms=int(step_timeout.total_seconds() * 1000))
        self._round, self._norms, self.refused = commit, [], None
        for sv in self.services:
            self.rounds[loop.send(sv.worker, sv.name, "round_norm", request, RoundNorm)] = sv

    def take(self, reply: Reply, loop: EventLoop) -> bool:
        """Whether ``reply`` answers a save or a held round's request. A save's answer is kept for the
        checkpoint (its part written, or why not: a refusal drops the checkpoint, never the job); the
        last norm of a round sends every shard its ``apply_round``; a refusal is kept in :attr:`refused`."""
        sv = self.rounds.pop(reply.id, None)
        if sv is not None:
            if not reply.ok:
                self.refused = reply
            elif isinstance(reply.body, RoundNorm):
                self._norms.append(reply.body.sq_norm)
                if len(self._norms) == len(self.services):
                    self._apply(loop)
            return True
        if reply.id not in self.saving:
            return False
        _, request = self.saving.pop(reply.id)
        if reply.ok and isinstance(reply.body, SavedPart):
            self._saved.append(reply.body)
        else:
            self._saved.append(SavedPart(step=request.save.step, part=request.part, error=(
                f"shard {reply.service} on {reply.worker}: [{reply.code}] {reply.message}"[:4000])))
        return True

    def _apply(self, loop: EventLoop) -> None:
        """Every shard's norm is in: send each the coefficient of their sum."""
        commit, max_norm = self._round, self.clip_grad_norm
        assert commit is not None and max_norm is not None
        request = ApplyRound(version=commit.step, grad_scale=clip_coefficient(sum(self._norms), max_norm),
                             train_step=commit.train_step)
        for sv in self.services:
            self.rounds[loop.send(sv.worker, sv.name, "apply_round", request, Empty)] = sv

    def saved(self) -> list[SavedPart]:
        """The parts the shards answered for since the last call."""
        taken, self._saved = self._saved, []
        return taken

    def forget(self, loop: EventLoop) -> None:
        """Stop waiting for the saves and round requests not answered (the runtime is closing)."""
        for i in [*self.saving, *self.rounds]:
            loop.forget(i)
        self.saving.clear()
        self.rounds.clear()
