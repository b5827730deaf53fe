"""Workers someone else started: the pods of a StatefulSet, or processes a launcher runs.

A session trains on a :class:`WorkerPool`: the names of its workers, their service-host
addresses and the registry they registered in. :class:`~coordinator.runtime.harness.LocalHarness`
is the pool of ``Resources.local`` (it starts the processes itself);
:class:`ClusterWorkers` is the pool of a cluster: it connects to the job's registry (etcd
in Kubernetes), waits, bounded, until the expected number of worker cards are there, and
describes them as :class:`~coordinator.planning.resources.Resources` for the planner, each worker
with the CPUs, memory and GPUs its card reports (a pod's limits).

Workers are ordered by the rank their launcher gave them (``RANK``/``PET_NODE_RANK``,
``services/host/launch.py``), then by name, so the plan places stage 0 on rank 0 whatever order
the pods came up in. Services the workers still host when the pool starts were left by a
coordinator that died (a restarted coordinator pod): they are released first.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from types import TracebackType
from typing import Protocol

from comm.codec import unpack
from comm.errors import ProtocolError, RegistryTimeoutError
from comm.registry import connect_registry
from comm.registry.base import KeyValue, Registry
from comm.rpc import RpcClient
from coordinator.planning.resources import CLUSTER_BANDWIDTH_BPS, CLUSTER_LATENCY_S, Resources, Worker
from services.protocol import Empty, Release, WorkerCard

__all__ = ["DEFAULT_MEMORY_FRACTION", "ClusterWorkers", "WorkerPool"]

log = logging.getLogger(__name__)

# a plan may fill this share of the memory a worker reports (the rest is the runtime's own)
DEFAULT_MEMORY_FRACTION = 0.8


class WorkerPool(Protocol):
    """Running workers a session places services on."""

    @property
    def names(self) -> list[str]: ...

    @property
    def job(self) -> str:
        """The registry prefix the workers registered under (``/cellmesh/{job}/workers/``)."""
        ...

    @property
    def registry(self) -> Registry: ...

    @property
    def registry_url(self) -> str:
        """What services on the workers connect to (``tcp://...``, ``etcd://...``)."""
        ...

    def address(self, name: str) -> str:
        """Worker ``name``'s service-host address."""
        ...

    def replace(self, name: str, timeout: timedelta) -> str | None:
        """A new process for lost worker ``name`` (started by the pool, or awaited from whoever restarts
        it); its address once registered, or None if none came within ``timeout``."""
        ...


class ClusterWorkers:
    """The job's registered workers, from a registry URL.

    Args:
        registry_url: ``etcd://host:port`` in a cluster (or ``tcp://`` for a served registry).
        job: The job's name; workers register under ``/cellmesh/{job}/workers/``.
        workers: How many workers the job needs.

    Keyword Args:
        timeout: Bounds :meth:`start`'s wait for the workers.
        request_timeout: Bounds each registry call.
    """

    def __init__(self, registry_url: str, job: str, workers: int, *,
                 timeout: timedelta = timedelta(minutes=10),
                 request_timeout: timedelta = timedelta(seconds=10)) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.registry_url = registry_url
        self.job = job
        self.expected = workers
        self.timeout = timeout
        self._request_timeout = request_timeout
        self._registry: Registry | None = None
        self.cards: dict[str, WorkerCard] = {}

    @property
    def registry(self) -> Registry:
        assert self._registry is not None, "start() first"
        return self._registry

    @property
    def names(self) -> list[str]:
        return list(self.cards)

    def address(self, name: str) -> str:
        return self.cards[name].address

    def replace(self, name: str, timeout: timedelta) -> str | None:
        """Wait (bounded) for worker ``name`` to register again as a new process: a pod the StatefulSet
        restarted re-registers under its name with a new incarnation. Its address, or None."""
        key, old = f"/cellmesh/{self.job}/workers/{name}", self.cards.get(name)
        deadline = time.monotonic() + timeout.total_seconds()
        with self.registry.watch(key) as watch:
            while True:
                kv = self.registry.get(key)
                if kv is not None:
                    try:
                        card = unpack(kv.value, WorkerCard)
                    except ProtocolError:
                        card = None
                    if card is not None and (old is None or card.incarnation != old.incarnation):
                        self.cards[name] = card
                        return card.address
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                watch.get(timedelta(seconds=min(1.0, left)))

    def _read_cards(self, prefix: str) -> list[WorkerCard]:
        return self._decode(self.registry.list(prefix), {})

    def _decode(self, items: list[KeyValue],
                decoded: dict[tuple[str, int], WorkerCard | None]) -> list[WorkerCard]:
        """The cards among ``items``, each entry decoded once (``decoded`` keeps them by key and revision)."""
        cards = []
        for kv in items:
            if (kv.key, kv.revision) not in decoded:
                try:
                    decoded[kv.key, kv.revision] = unpack(kv.value, WorkerCard)
                except ProtocolError as exc:  # not a worker of this version: say so, wait for real ones
                    log.warning("[coordinator %s] ignoring %s: %s", self.job, kv.key, exc)
                    decoded[kv.key, kv.revision] = None
            card = decoded[kv.key, kv.revision]
            if card is not None:
                cards.append(card)
        return cards

    def start(self, progress: timedelta = timedelta(seconds=15)) -> ClusterWorkers:
        """Connect and wait until ``workers`` cards are registered; log who is there every ``progress``.

        The wait follows the registry's events (:meth:`Registry.wait_for`): a thousand workers
        registering cost a thousand events and a few listings, not a listing per arrival.

        Raises:
            TimeoutError: Naming how many workers registered (and which) within ``timeout``.
            ValueError: A card's world size disagrees with ``workers``, or two cards claim one rank.
        """
        self._registry = connect_registry(self.registry_url, request_timeout=self._request_timeout)
        prefix = f"/cellmesh/{self.job}/workers/"
        deadline = time.monotonic() + self.timeout.total_seconds()
        decoded: dict[tuple[str, int], WorkerCard | None] = {}
        while True:
            left = deadline - time.monotonic()
            try:
                items = self.registry.wait_for(
                    prefix, lambda kvs: len(self._decode(kvs, decoded)) >= self.expected,
                    timeout=timedelta(seconds=max(0.0, min(left, progress.total_seconds()))),
                    what=f"{self.expected} workers")
                cards = self._decode(items, decoded)
                break
            except RegistryTimeoutError:
                cards = self._read_cards(prefix)
            if time.monotonic() >= deadline:
                present = ", ".join(c.name for c in cards) or "none"
                raise TimeoutError(
                    f"{len(cards)} of {self.expected} workers registered under {prefix} in "
                    f"{self.registry_url} within {self.timeout.total_seconds():.0f}s ({present}); check "
                    f"that the workers run with --registry pointing at it and --job {self.job}")
            log.info("[coordinator %s] %d of %d workers registered", self.job, len(cards), self.expected)
        self.cards = {c.name: c for c in self._choose(cards)}
        self._release_leftovers()
        return self

    def _release_leftovers(self, timeout: timedelta = timedelta(seconds=10)) -> None:
        """Release services a coordinator that died without cleaning up left on the workers.

        The job's workers serve one coordinator at a time (the Deployment recreates it), so
        whatever they host when a coordinator starts belongs to a predecessor: its step
        threads may be blocked on peers that will never answer, and it holds memory.
        """
        for card in self.cards.values():
            if not card.services:
                continue
            log.warning("[coordinator %s] releasing %s on %s, left by an earlier coordinator", self.job,
                        ", ".join(card.services), card.name)
            client = RpcClient(card.address, timeout=timeout)
            try:
                for service in card.services:
                    client.call("worker", "release", Release(service=service), Empty)
            finally:
                client.close()

    def _choose(self, cards: list[WorkerCard]) -> list[WorkerCard]:
        for card in cards:
            if card.world_size is not None and card.world_size != self.expected:
                raise ValueError(f"worker {card.name} says WORLD_SIZE={card.world_size}, the job expects "
                                 f"{self.expected} workers; render the manifests again or fix --workers")
        ranks = [c.rank for c in cards if c.rank is not None]
        dupes = sorted({r for r in ranks if ranks.count(r) > 1})
        if dupes:
            claimants = [c.name for c in cards if c.rank in dupes]
            raise ValueError(f"workers {claimants} claim the same rank {dupes}")
        ordered = sorted(cards, key=lambda c: (c.rank is None, c.rank or 0, c.name))
        if len(ordered) > self.expected:
            log.warning("[coordinator %s] %d workers registered, the job uses %d: %s", self.job, len(ordered),
                        self.expected, ", ".join(c.name for c in ordered[:self.expected]))
        return ordered[:self.expected]

    def resources(self, memory_fraction: float = DEFAULT_MEMORY_FRACTION) -> Resources:
        """The registered workers as the planner's resource list: each a host of its own (a pod),
        linked by :data:`~coordinator.planning.resources.CLUSTER_BANDWIDTH_BPS`."""
        if not self.cards:
            raise RuntimeError("start() first")
        return Resources(workers=tuple(
            Worker(name=c.name, device="cuda" if c.gpus else "cpu", cpus=c.cpus, gpus=c.gpus,
                   memory_bytes=max(1, int(c.memory_bytes * memory_fraction)))
            for c in self.cards.values()), bandwidth_bps=CLUSTER_BANDWIDTH_BPS, latency_s=CLUSTER_LATENCY_S)

    def close(self) -> None:
        if self._registry is not None:
            self._registry.close()
            self._registry = None

    def __enter__(self) -> ClusterWorkers:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
