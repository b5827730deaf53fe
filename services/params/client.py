"""One replica's client of a sharded push/pull parameter service.

:func:`setup_shards` splits a parameter set over the shards (balanced by bytes, see
:func:`services.params.sharding.plan_shards`) and sends each shard its part. A
:class:`PushPullClient` learns from the shards themselves (their ``info``) which shard
owns which parameter; every ``pull`` and ``push`` then goes to all shards at once, each
shard's share cut into parts of about :data:`~services.params.sharding.PART_BYTES` (one message
per part), all sent before any reply is awaited (:func:`comm.rpc.pipeline.run_calls`).
So the shards work concurrently, a shard accumulates early parts of a push while later
ones are on the wire, and the client copies early parts of a pull while later ones are.

Pulled values are copied from the received frames straight into the caller's tensors;
pushed gradients leave as zero-copy frames of the caller's tensors. See
:mod:`services.params.server` for versions, steps, clocks and parts.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal, NamedTuple

import torch

from comm.rpc.pipeline import PipelinedCall, PipelinedConnection, run_calls
from comm.wire import DTYPES, dtype_name
from services.params.sharding import (
    PART_BYTES,
    ShardPlan,
    check_pieces,
    group_parts,
    join_pieces,
    plan_shards,
    split_pieces,
)
from services.protocol import (
    Empty,
    OptimizerSpec,
    ParamInfo,
    PullReply,
    PullRequest,
    PushReply,
    PushRequest,
    ShardInfo,
    ShardSetup,
)

__all__ = ["PULL_SLACK", "PushPullClient", "ShardRef", "setup_shards"]

log = logging.getLogger(__name__)

PULL_SLACK = timedelta(seconds=5)  # the client waits this much past the shard's own pull timeout


class ShardRef(NamedTuple):
    """Where one shard is served: its worker's address and its service name there."""

    address: str
    service: str


def setup_shards(
    shards: Sequence[ShardRef],
    params: Mapping[str, torch.Tensor],
    *,
    mode: Literal["sync", "async"],
    replicas: int,
    optimizer: OptimizerSpec,
    staleness: int = 0,
    timeout: timedelta = timedelta(seconds=60),
    keys: Mapping[str, str] | None = None,
    restore: str = "",
    hold_rounds: bool = False,
) -> ShardPlan:
    """Place ``params`` on ``shards`` (balanced by bytes) and set every shard up, concurrently.

    Args:
        shards: freshly assigned ``param_server`` services.
        params: the initial values (floating point), by name.
        mode: ``"sync"`` or ``"async"``.
        replicas: the number of data-parallel replicas that will push.
        optimizer: the ``torch.optim`` optimizer each shard runs over its part.
        staleness: async only, the bound S (see :mod:`services.params.server`).
        timeout: for all shards together.
        keys: each parameter's key in checkpoints (absent: its name; see
            :mod:`services.params.shard_state`).
        restore: a checkpoint whose optimizer state the shards start from ("": a fresh optimizer).
        hold_rounds: sync only: each complete round waits for the coordinator's ``apply_round``
            (clipping by the global norm: :mod:`services.params.server`).

    Returns:
        The plan: which shard holds which parameter.

    Raises:
        ValueError: a shard would be left without parameters (use fewer shards).
        RpcError: a shard refused its setup (already set up, a bad optimizer, a checkpoint it
            cannot restore from...).
        TimeoutError: a shard did not answer within ``timeout``.
    """
    plan = plan_shards({n: t.numel() * t.element_size() for n, t in params.items()}, len(shards))
    empty = [shards[i].service for i, names in enumerate(plan.shards) if not names]
    if empty:
        raise ValueError(f"{len(params)} parameters cannot fill {len(shards)} shards: {empty} would be empty")
    conns = [PipelinedConnection(s.address) for s in shards]
    try:
        calls = []
        for shard, conn, names in zip(shards, conns, plan.shards, strict=True):
            infos = [ParamInfo(name=n, dtype=dtype_name(params[n].dtype), shape=list(params[n].shape))
                     for n in names]
            request = ShardSetup(mode=mode, replicas=replicas, optimizer=optimizer, staleness=staleness,
                                 params=infos, restore=restore, hold_rounds=hold_rounds,
                                 keys={n: keys[n] for n in names if keys is not None and n in keys})
            pieces = [p for n in names for p in split_pieces(n, params[n])]
            calls.append(PipelinedCall(conn, shard.service, "setup", request, ShardInfo, pieces))
        run_calls(calls, lambda index, body, tensors: None, timeout=timeout)
    finally:
        for conn in conns:
            conn.close()
    log.info("set up %d shards, bytes per shard %s", len(shards), list(plan.loads))
    return plan


@dataclass
class _Part:
    """What a call of a fan-out carries: which shard, which parameters, pull or push."""

    shard: int
    names: list[str]
    kind: Literal["pull", "push"]


class PushPullClient:
    """Pull parameters from and push gradients to every shard, as data-parallel replica ``replica``.

    Use from one thread at a time. Every call is bounded: parts a shard did not answer
    within the timeout are sent again ``retries`` times (push parts keep their ``(replica,
    step, seq, part)``, so a part that did arrive is applied once), then the call raises.

    Args:
        shards: the set-up shards of one parameter service.
        replica: this replica's index, ``0 <= replica < replicas``.
        timeout: the default bound of one attempt of a call (a pull's wait included).
        retries: extra attempts after a timeout.
        part_bytes: about how many bytes one message of a push or pull carries.

    Raises:
        RuntimeError: a shard is not set up, or two shards claim one parameter.
        TimeoutError: a shard did not answer ``info``.
    """

    def __init__(self, shards: Sequence[ShardRef], replica: int, *,
                 timeout: timedelta = timedelta(seconds=60), retries: int = 2,
                 part_bytes: int = PART_BYTES) -> None:
        self.shards = list(shards)
        self.replica = replica
        self.timeout = timeout
        self.retries = retries
        self.part_bytes = part_bytes
        self._conns = [PipelinedConnection(s.address) for s in self.shards]
        self._seq = 0
        self.params: dict[str, ParamInfo] = {}
        self.owner: dict[str, int] = {}
        self.last_pull: list[PullReply | None] = [None] * len(self.shards)
        self.last_push: list[PushReply | None] = [None] * len(self.shards)
        infos: dict[int, ShardInfo] = {}
        run_calls([PipelinedCall(conn, s.service, "info", Empty(), ShardInfo)
                   for conn, s in zip(self._conns, self.shards, strict=True)],
                  lambda index, body, tensors: infos.__setitem__(index, body), timeout=timeout)
        for i, shard in enumerate(self.shards):
            if not infos[i].ready:
                raise RuntimeError(f"shard {shard.service!r} at {shard.address} is not set up")
            for p in infos[i].params:
                if p.name in self.owner:
                    raise RuntimeError(f"parameter {p.name!r} is held by shards {self.owner[p.name]} and {i}")
                self.owner[p.name] = i
                self.params[p.name] = p
        self._nbytes = {n: math.prod(p.shape) * DTYPES[p.dtype].itemsize for n, p in self.params.items()}

    def pull(self, into: Mapping[str, torch.Tensor], min_version: int = 0, *,
             timeout: timedelta | None = None) -> int:
        """Copy the current values of ``into``'s parameters into its tensors; return the version.

        Waits until every shard involved reached ``min_version`` (and, async, until this
        replica is within the staleness bound). The returned version is the lowest any part
        was served at (``last_pull`` has a reply per shard; in async mode the parts of one
        shard may be served at different versions).

        Raises:
            KeyError: ``into`` names a parameter no shard holds.
            ValueError: ``into`` is empty or one of its tensors has the wrong shape.
            RpcError: a shard refused or its wait ran out (code ``timeout``).
            TimeoutError: a shard did not answer after the retries.
        """
        if not into:
            raise ValueError("pull: `into` names no parameter")
        return self._run([], into, min_version, timeout)

    def push(self, grads: Mapping[str, torch.Tensor | None], step: int, *,
             timeout: timedelta | None = None, train_step: int | None = None) -> None:
        """Send this replica's gradients for ``step`` to every shard (``None`` gradients are left out).

        Every shard gets a push, even one with no gradient in ``grads`` (in sync mode a
        shard closes a step only once every replica pushed). ``train_step``: the training step
        the update belongs to, for the shards' learning-rate scheduler (``PushRequest``).
        Returns once every shard took every part; the gradients may then be reused. After a
        raise, a part may still be queued for an unresponsive shard: keep ``grads`` unchanged
        until the next call.

        Raises:
            KeyError: ``grads`` names a parameter no shard holds.
            RpcError: a shard refused (``step_closed``, ``step_ahead``, ``bad_request``...).
            TimeoutError: a shard did not answer after the retries.
        """
        self._run(self._push_calls(grads, step, train_step), {}, 0, timeout)

    def push_pull(self, grads: Mapping[str, torch.Tensor | None], step: int,
                  into: Mapping[str, torch.Tensor], min_version: int, *,
                  timeout: timedelta | None = None, train_step: int | None = None) -> int:
        """:meth:`push` then :meth:`pull`, with every request sent before any reply is awaited.

        The pull parts queue behind the push parts on each shard's connection, so a sync
        shard answers them as soon as the step's update is applied: one round trip less.
        If a push part is refused, the call raises once every push part was answered,
        without waiting for the pulls.

        Raises:
            What :meth:`push` and :meth:`pull` raise.
        """
        return self._run(self._push_calls(grads, step, train_step), into, min_version, timeout)

    def close(self) -> None:
        for conn in self._conns:
            conn.close()

    def __enter__(self) -> PushPullClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers ---------------------------------------------------------------------

    def _check_names(self, tensors: Mapping[str, object], what: str) -> None:
        unknown = [n for n in tensors if n not in self.owner]
        if unknown:
            raise KeyError(f"{what}: no shard holds parameters {unknown}; held: {list(self.owner)[:8]}")

    def _parts(self, shard: int, names: Sequence[str]) -> list[list[str]]:
        """``names`` held by ``shard``, in the shard's order, grouped into parts."""
        wanted = set(names)
        sizes = {n: self._nbytes[n] for n in self.params if self.owner[n] == shard and n in wanted}
        return group_parts(sizes, self.part_bytes)

    def _push_calls(self, grads: Mapping[str, torch.Tensor | None], step: int,
                    train_step: int | None) -> list[tuple[PipelinedCall, _Part]]:
        present = {n: g for n, g in grads.items() if g is not None}
        self._check_names(present, "push")
        seq = self._seq
        self._seq += 1
        calls: list[tuple[PipelinedCall, _Part]] = []
        for i, (conn, shard) in enumerate(zip(self._conns, self.shards, strict=True)):
            groups = self._parts(i, list(present)) or [[]]
            for k, names in enumerate(groups):
                pieces = [p for n in names
                          for p in split_pieces(n, present[n].detach().to(DTYPES[self.params[n].dtype]))]
                request = PushRequest(replica=self.replica, step=step, seq=seq, part=k, parts=len(groups),
                                      train_step=train_step)
                calls.append((PipelinedCall(conn, shard.service, "push", request, PushReply, pieces),
                              _Part(i, names, "push")))
        return calls

    def _run(self, push_calls: list[tuple[PipelinedCall, _Part]], into: Mapping[str, torch.Tensor],
             min_version: int, timeout: timedelta | None) -> int:
        """Send the push parts, then pull parts for ``into``; collect all; the lowest version pulled."""
        limit = self.timeout if timeout is None else timeout
        calls = list(push_calls)
        if into:
            self._check_names(into, "pull")
            for name, dst in into.items():
                if list(dst.shape) != self.params[name].shape:
                    raise ValueError(f"pull into {name!r}: shape {list(dst.shape)}, the shard holds "
                                     f"{self.params[name].shape}")
            for i, (conn, shard) in enumerate(zip(self._conns, self.shards, strict=True)):
                for names in self._parts(i, list(into)):
                    request = PullRequest(replica=self.replica, min_version=min_version,
                                          timeout_ms=int(limit.total_seconds() * 1000), params=names)
                    call = PipelinedCall(conn, shard.service, "pull", request, PullReply, optional=True)
                    calls.append((call, _Part(i, names, "pull")))
            limit += PULL_SLACK
        versions: list[int] = []

        def on_reply(index: int, body: Any, tensors: dict[str, torch.Tensor]) -> None:
            part = calls[index][1]
            if part.kind == "push":
                self.last_push[part.shard] = body
                return
            self._copy_into(into, part.names, tensors)
            self.last_pull[part.shard] = body
            versions.append(body.version)

        run_calls([c for c, _ in calls], on_reply, timeout=limit, retries=self.retries)
        return min(versions, default=-1)

    def _copy_into(self, into: Mapping[str, torch.Tensor], names: list[str],
                   tensors: Mapping[str, torch.Tensor]) -> None:
        pieces = join_pieces(tensors)
        if sorted(pieces) != sorted(names):
            raise RuntimeError(f"pull reply holds parameters {sorted(pieces)}, expected {sorted(names)}")
        with torch.no_grad():
            for name in names:
                dst = into[name]
                parts = check_pieces(name, pieces[name], dst.numel(), DTYPES[self.params[name].dtype])
                flat = dst.view(-1) if dst.is_contiguous() else torch.empty(dst.numel(), dtype=dst.dtype)
                for s, piece in parts:
                    flat[s].copy_(piece)
                if not dst.is_contiguous():
                    dst.copy_(flat.view(dst.shape))
