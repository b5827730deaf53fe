"""Tied parameters across pipeline stages: every holder's copy gets the summed gradient and the same update.

[Note: tied parameters]
A GPT-style model uses one Parameter in its first cell (the token embedding) and its last (the
output head). Every stage builds the whole model and keeps its own cells, so in a pipeline
both the first and the last stage hold a copy of that Parameter, and each copy's ``.grad``
holds only its own stage's part of the gradient. One process's autograd sums the two uses; so
must the pipeline, or the copies drift apart from each other and from one process.

* Found by the coordinator (``coordinator/runtime/tied.py``): a Parameter that the cells of
  more than one stage hold (by identity in the model the factory returns) is tied across
  those stages. Each holder gets ``ComputeOptions.tied``: its own name of the parameter,
  the name all holders share (``key``: the lowest holder's name) and the holding stages.
* Summed here, as Megatron sums its embedding group: at the end of a step that trains, after
  the stage's last backward and its data-parallel gradient path (so each copy already holds
  its stage's gradient averaged over the replicas), the holders of one replica all-reduce
  (SUM) the copies' gradients. Averaging over replicas and summing over stages are linear,
  so either order gives the gradient of the global mean loss. Averaging first is the cheaper
  order here: the data-parallel all-reduce of every other parameter runs anyway, bucketed and
  overlapped with backward, and the tied group stays within one pipeline (2 ranks for an
  embedding and a head, however many replicas). Its timing is the reply's ``tied_sync`` phase.
* Then every holder applies the same optimizer to the same value with the same gradient
  (an all-reduce gives every rank bitwise the same result), so the copies stay bit-identical
  without a second collective. Non-finite checks and commits see the summed gradient. A
  norm over the whole model's gradients (clipping) must count a tied parameter once: on its
  owner, not on the stages listed as its :attr:`TiedSync.mirrors`.
* A step that adds to the gradients it starts with (``RunStep.zero_grad`` False: accumulating
  several batches into one update) starts with copies that already hold the same sum. Summed
  again they would count it once per holder; so the step sets the tied gradients aside as it
  begins (:meth:`TiedSync.begin`), sums only what it adds, and adds them back. (The replicas'
  average needs no such care: averaging equal values returns them.)
* Parameter-server mode: each stage's shards hold that stage's parameters under its own names,
  so two shards would each run an optimizer on a copy. Instead only the owner (lowest holder)
  pushes the summed gradient to its shard and pulls the new value; the other holders leave the
  parameter out of push/pull and receive the value from the owner (a broadcast in the commit,
  :meth:`TiedSync.share`). One optimizer state, one value, no refusal needed.
* Checkpoints: the owner writes the tensor (and its optimizer state) under the model's keys;
  a mirror (a holder that is not the owner) writes nothing of it and restores its copy from
  the same keys (``ComputeOptions.state_keys`` maps its name to them).

The holders of one set of stages form one communicator per replica under
``{TiedOptions.prefix}/s{a}-{b}...`` (rank = position in the set), joined in the background
from the assignment, as the pipeline's. Groups are served in ascending order of their
stages, every holder the same, so groups sharing a stage cannot wait on each other in a
cycle. Every wait is bounded by the step's deadline.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
from torch import nn

from comm.base import Communicator, ReduceOp
from services.link import PipelineLink
from services.protocol import ComputeOptions, PhaseTiming

__all__ = ["TiedSync", "group_prefix"]


def group_prefix(prefix: str, stages: Sequence[int]) -> str:
    """Where the holders ``stages`` of one replica meet: ``{prefix}/s0-3``."""
    return f"{prefix}/s{'-'.join(str(s) for s in stages)}"


@dataclass
class _Group:
    stages: tuple[int, ...]
    link: PipelineLink
    params: list[tuple[str, nn.Parameter]]  # (key, the copy), in key order: every holder's order


class TiedSync:
    """A stage's tied parameters and the groups that keep its copies equal to the other holders'.

    Args:
        params: The stage's parameters (``Stage.parameters()``).
        options: The stage's options; ``options.tied`` must be set.

    Attributes:
        mirrors: The names of the tied parameters another stage owns: they are not written into
            checkpoints nor pushed to a parameter shard by this stage.

    Raises:
        ValueError: A tied name is not one of the stage's parameters, or the registry URL is malformed.
    """

    def __init__(self, params: Sequence[tuple[str, nn.Parameter]], options: ComputeOptions) -> None:
        tied = options.tied
        assert tied is not None, "no tied parameters"
        held = dict(params)
        unknown = [p.name for p in tied.params if p.name not in held]
        if unknown:
            raise ValueError(f"tied parameters {unknown} are not parameters of stage {options.stage} "
                             f"(it holds {list(held)[:8]}...)")
        self._stage = options.stage
        self._carried: list[tuple[nn.Parameter, torch.Tensor]] = []  # set aside by begin(), added by sync()
        self.mirrors = frozenset(p.name for p in tied.params if p.owner != options.stage)
        by_stages: dict[tuple[int, ...], list[tuple[str, nn.Parameter]]] = {}
        for p in tied.params:
            by_stages.setdefault(tuple(p.stages), []).append((p.key, held[p.name]))
        timeout = timedelta(milliseconds=options.comm_timeout_ms)
        self._groups = [
            _Group(stages, PipelineLink(backend=options.comm_backend, rank=stages.index(options.stage),
                                        world_size=len(stages), registry_url=options.registry,
                                        prefix=group_prefix(tied.prefix, stages), timeout=timeout),
                   sorted(members, key=lambda m: m[0]))
            for stages, members in sorted(by_stages.items())]

    @classmethod
    def build(cls, params: Sequence[tuple[str, nn.Parameter]], options: ComputeOptions) -> TiedSync | None:
        """The stage's tied synchronisation; None when ``options`` name no tied parameter."""
        return cls(params, options) if options.tied is not None else None

    def begin(self, zero_grad: bool) -> None:
        """A step that trains begins (its gradients cleared first if ``zero_grad``): without ``zero_grad``,
        set the tied gradients aside (they are sums already) so that :meth:`sync` sums only the step's own."""
        self._carried = []
        if zero_grad:
            return
        for group in self._groups:
            for _, param in group.params:
                if param.grad is not None:
                    # a copy: the gradient may be a view into a data-parallel bucket, which the step refills
                    self._carried.append((param, param.grad.detach().clone()))
                    param.grad = None

    def sync(self, timeout: timedelta) -> PhaseTiming:
        """Replace each tied copy's gradient by the sum over its holders (a missing one counts as zeros),
        plus what :meth:`begin` set aside.

        Raises:
            TimeoutError: A group did not form, or its all-reduce did not finish, within ``timeout``.
            RuntimeError: A group's communicator could not be built or failed.
        """
        start, deadline = time.time(), time.monotonic() + timeout.total_seconds()
        for group in self._groups:
            comm = self._comm(group, deadline)
            for key, param in group.params:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                elif not param.grad.is_contiguous():
                    param.grad = param.grad.contiguous()
                comm.all_reduce(param.grad, ReduceOp.SUM, timeout=self._left(deadline, f"summing {key!r}"))
        for param, carried in self._carried:
            assert param.grad is not None  # every tied copy has one after the loop above
            param.grad.add_(carried)
        self._carried = []
        return PhaseTiming(name="tied_sync", start=start, end=time.time())

    def share(self, timeout: timedelta) -> PhaseTiming:
        """Parameter-server mode, after the commit's push/pull: copy each tied value from its owner
        (the only holder that pulled it) into every other holder's copy.

        Raises:
            TimeoutError: A group did not form, or a broadcast did not finish, within ``timeout``.
            RuntimeError: A group's communicator could not be built or failed.
        """
        start, deadline = time.time(), time.monotonic() + timeout.total_seconds()
        for group in self._groups:
            comm = self._comm(group, deadline)
            for key, param in group.params:
                comm.broadcast(param.detach(), 0, timeout=self._left(deadline, f"sharing {key!r}"))
        return PhaseTiming(name="tied_share", start=start, end=time.time())

    def reconnect(self, prefix: str) -> None:
        """Join every group anew under ``prefix`` (a new generation; every holder does the same)."""
        for group in self._groups:
            group.link.connect(group_prefix(prefix, group.stages))

    def close(self) -> None:
        for group in self._groups:
            group.link.close()

    def _comm(self, group: _Group, deadline: float) -> Communicator:
        left = self._left(deadline, f"the tied-parameter group of stages {list(group.stages)} formed")
        try:
            comm = group.link.wait(left)
        except TimeoutError as exc:
            raise TimeoutError(f"stage {self._stage}: the tied-parameter group of stages "
                               f"{list(group.stages)}: {exc}") from None
        assert comm is not None  # a group holds at least two stages
        return comm

    def _left(self, deadline: float, what: str) -> timedelta:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"stage {self._stage}: the time allowed ran out before {what}")
        return timedelta(seconds=left)

