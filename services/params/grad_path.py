"""A stage's gradient path between its data-parallel replicas: none, collective all-reduce, or push/pull.

Collective mode and parameter-server mode are the same service graph with a different
gradient path. The compute service owns one path per stage and
calls it at fixed points of a step::

    run_step:  begin(timeout)          before the first action (waits for the group, bounded)
               arm()                   just before the stage's last backward of the step
               finish(timeout)         after the action list (collective: wait for the buckets)
    commit:    exchange(step, ...)     parameter server only: push gradients, pull new values
               (otherwise the service's local optimizer applies the update)

[Note: microbatches and the all-reduce]
A pipeline stage runs one backward per microbatch and its parameter gradients accumulate
over them. The all-reduce must see the sum, so :class:`~services.params.grad_sync.GradSync`'s
hooks are disarmed for every backward but the last: during the last one each hook fires
once the gradient holds every microbatch's contribution, and its bucket goes out while
backward continues with earlier layers (the overlap). A stage whose loss weights
microbatches by ``n_m / N`` (``services/compute/executor.py``) then holds its replica's mean-loss
gradient, and the all-reduce MEAN over ``d`` equal replicas gives the gradient of the
mean over the global batch: what one process computes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from datetime import timedelta

import torch
from torch import nn

from comm.base import Communicator
from services.link import PipelineLink
from services.params.client import PushPullClient, ShardRef
from services.params.grad_sync import GradSync
from services.protocol import ComputeOptions, PhaseTiming, ShardAddress

__all__ = ["CollectivePath", "GradientPath", "ServerPath", "build_path"]

log = logging.getLogger(__name__)


class GradientPath:
    """One replica: nothing to synchronise; the service's local optimizer applies the update.

    Attributes:
        updates_locally: True if the service's own optimizer applies the update at commit.
        launched: True once a step armed the path (a failure after that may leave collectives
            in flight: the path must be reconnected before the next step).
    """

    updates_locally = True

    def __init__(self) -> None:
        self.launched = False
        self.lead: int | None = None  # async parameter server: see ServerPath

    def begin(self, timeout: timedelta) -> None:
        """Prepare for a step (collective: wait for the group to form, bounded by ``timeout``)."""

    def group(self) -> Communicator | None:
        """The replicas' communicator once :meth:`begin` returned (collective mode; else None)."""
        return None

    def arm(self) -> None:
        """The stage's last backward of the step comes next."""

    def finish(self, timeout: timedelta) -> PhaseTiming | None:
        """After the action list: the gradients are final (averaged over replicas) on return."""
        return None

    def held_grads(self, params: Sequence[tuple[str, nn.Parameter]]) -> list[tuple[str, torch.Tensor]]:
        """After :meth:`finish`: the gradients of ``params`` this replica holds, by name (a ZeRO-2
        replica: its shards; otherwise each ``.grad`` that is not None)."""
        return [(n, p.grad) for n, p in params if p.grad is not None]

    def exchange(self, step: int, params: Sequence[tuple[str, nn.Parameter]],
                 timeout: timedelta, *, train_step: int) -> PhaseTiming | None:
        """Parameter server: push this step's gradients, pull the updated values into ``params``.

        ``train_step`` is the training step the update belongs to (the shards' scheduler position).
        """
        return None

    def abandon(self) -> None:
        """Forget a step that failed midway."""

    def reconnect(self, prefix: str) -> None:
        """Join a new group under ``prefix`` (a new generation); a no-op without a group."""

    def close(self) -> None:
        """Release communicators and connections."""


class CollectivePath(GradientPath):
    """Bucketed, overlapped all-reduce MEAN among the replicas of one stage.

    Args:
        module: The stage's module (its parameters are synchronised).
        options: The stage's options (backend, replica, num_replicas, dp_prefix, registry,
            comm_timeout_ms bounding the rendezvous, bucket_bytes).

    Raises:
        ValueError: The registry URL is malformed.
    """

    def __init__(self, module: nn.Module, options: ComputeOptions) -> None:
        super().__init__()
        self._module = module
        self._bucket_bytes = options.bucket_bytes
        self._replica = options.replica
        self._link = PipelineLink(backend=options.data_parallel_backend, rank=options.replica,
                                  world_size=options.num_replicas, registry_url=options.registry,
                                  prefix=options.dp_prefix,
                                  timeout=timedelta(milliseconds=options.comm_timeout_ms))
        self._sync: GradSync | None = None
        self._comm: Communicator | None = None

    def begin(self, timeout: timedelta) -> None:
        try:
            comm = self._link.wait(timeout)
        except TimeoutError as exc:
            raise TimeoutError(f"replica {self._replica}: the data-parallel group: {exc}") from None
        assert comm is not None  # num_replicas > 1
        self._comm = comm
        if self._sync is None:
            self._sync = GradSync(self._module, comm, bucket_bytes=self._bucket_bytes, timeout=timeout)
        self._sync.timeout = timeout
        self._sync.armed = False
        self.launched = False

    def arm(self) -> None:
        assert self._sync is not None, "begin() first"
        self._sync.armed = True
        self.launched = True

    def finish(self, timeout: timedelta) -> PhaseTiming | None:
        assert self._sync is not None, "begin() first"
        start = time.time()
        self._sync.timeout = timeout
        self._sync.finish()
        self._sync.armed = False
        return PhaseTiming(name="all_reduce", start=start, end=time.time())

    def group(self) -> Communicator | None:
        return self._comm

    def abandon(self) -> None:
        if self._sync is not None:
            self._sync.reset()
            self._sync.armed = False

    def reconnect(self, prefix: str) -> None:
        if self._sync is not None:
            self._sync.close()
            self._sync = None
        self._comm = None
        self.launched = False
        self._link.connect(prefix)

    def close(self) -> None:
        if self._sync is not None:
            self._sync.close()
        self._link.close()


class ServerPath(GradientPath):
    """Push gradients to the stage's parameter shards and pull the updated values (synchronous mode).

    Tensors travel on the CPU: a stage on a GPU pushes CPU copies of its gradients and pulls into
    CPU buffers, copied into its parameters once every part arrived. The shards' step is the
    number of updates they applied, so ``exchange`` must be called with steps 0, 1, 2, ... in
    order (the coordinator's commit count). The client is built on the first exchange: the
    coordinator sets the shards up after assigning the stage.

    Asynchronous shards (``plan.staleness``) take the same push and pull: each push is applied on
    arrival and the pull waits until this replica is within the staleness bound of the slowest;
    :attr:`lead` is then how far ahead of the slowest this replica's clock was as its last pull was
    served (the most over the shards; 0 in sync mode, whose pulls wait for the whole round).

    Args:
        shards: This stage's shards (empty: the stage has no parameters; exchange does nothing).
        replica: This replica's index.
    """

    updates_locally = False

    def __init__(self, shards: Sequence[ShardAddress], replica: int) -> None:
        super().__init__()
        self._shards = [ShardRef(s.address, s.service) for s in shards]
        self._replica = replica
        self._client: PushPullClient | None = None

    def exchange(self, step: int, params: Sequence[tuple[str, nn.Parameter]],
                 timeout: timedelta, *, train_step: int) -> PhaseTiming | None:
        if not self._shards:
            return None
        start = time.time()
        if self._client is None:
            self._client = PushPullClient(self._shards, self._replica, timeout=timeout, retries=0)
        grads = {name: None if p.grad is None else p.grad.detach().to("cpu") for name, p in params}
        into = {name: p.detach() if p.device.type == "cpu" else torch.empty_like(p, device="cpu")
                for name, p in params}  # a CPU parameter is pulled into in place
        self._client.push_pull(grads, step, into, min_version=step + 1, timeout=timeout,
                               train_step=train_step)
        clocks = [r.clocks for r in self._client.last_pull if r is not None and r.clocks]
        self.lead = max(c[self._replica] - min(c) for c in clocks) if clocks else None
        with torch.no_grad():
            for name, p in params:
                if p.device.type != "cpu":  # pulled into a CPU copy: onto the parameter's device
                    p.copy_(into[name])
        return PhaseTiming(name="push_pull", start=start, end=time.time())

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


def build_path(module: nn.Module, options: ComputeOptions) -> GradientPath:
    """The gradient path ``options`` describe for a stage running ``module``."""
    if options.grad_path == "parameter_server":
        return ServerPath(options.shards, options.replica)
    if options.num_replicas == 1:
        return GradientPath()
    if options.zero_stage in (1, 2):
        from services.params.zero import ZeroPath  # it builds on CollectivePath

        return ZeroPath(module, options)
    if options.zero_stage == 3:
        from services.params.sharded_path import FullyShardedPath  # it builds on CollectivePath

        return FullyShardedPath(module, options)
    return CollectivePath(module, options)
