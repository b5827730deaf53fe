"""A pipeline's communicator, joined in the background so that assigning a stage never blocks.

The stages of one pipeline form one communicator (rank = stage index). Its rendezvous
blocks until every stage has joined, while the coordinator assigns stages one after
another; so a stage starts joining when it is assigned and its first step waits for the
join to finish (bounded). :meth:`PipelineLink.connect` replaces the communicator by a
new one under a new prefix (a new generation) -- every stage of the pipeline must do the
same, as with any rendezvous.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import timedelta

from comm.base import Communicator
from comm.factory import init_communicator
from comm.registry import connect_registry
from comm.registry.base import Registry

__all__ = ["PipelineLink"]

log = logging.getLogger(__name__)


class PipelineLink:
    """The communicator of stage ``rank`` of a ``world_size``-stage pipeline; None for one stage.

    Args:
        backend: A ``comm`` backend name (``zmq``, ``gloo``, ``nccl``, ``auto``).
        rank: This stage's index.
        world_size: The number of stages.
        registry_url: Where the stages meet (``tcp://...``, ``etcd://...``); unused for one stage.
        prefix: The rendezvous prefix of the first communicator.
        timeout: Bounds the rendezvous; the communicator's default per-transfer timeout.

    Raises:
        ValueError: The registry URL is malformed.
    """

    def __init__(self, *, backend: str, rank: int, world_size: int, registry_url: str, prefix: str,
                 timeout: timedelta) -> None:
        self.backend = backend
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.prefix = prefix
        self._lock = threading.Lock()
        self._closed = False
        self._future: Future[Communicator | None] = Future()
        self._registry: Registry | None = connect_registry(registry_url) if world_size > 1 else None
        self.connect(prefix)

    def connect(self, prefix: str) -> None:
        """Drop the current communicator (closing it once built) and start joining one under ``prefix``."""
        future: Future[Communicator | None] = Future()
        with self._lock:
            old, self._future, self.prefix = self._future, future, prefix
        _close(old)
        if self.world_size == 1:
            future.set_result(None)
            return
        threading.Thread(target=self._join, args=(future, prefix), daemon=True,
                         name=f"pipeline-link-{self.rank}").start()

    def _join(self, future: Future[Communicator | None], prefix: str) -> None:
        assert self._registry is not None
        try:
            comm = init_communicator(self.backend, rank=self.rank, world_size=self.world_size,
                                     registry=self._registry, prefix=prefix, timeout=self.timeout)
        except BaseException as exc:
            log.error("[stage %d] could not join the pipeline communicator %s: %s", self.rank, prefix, exc)
            future.set_exception(exc)
            return
        with self._lock:
            stale = self._closed or future is not self._future
        if stale:  # replaced or closed while joining
            comm.close()
            future.set_exception(RuntimeError(f"the communicator under {prefix!r} was replaced"))
            return
        log.info("[stage %d] joined the pipeline communicator %s (%s)", self.rank, prefix, self.backend)
        future.set_result(comm)

    def wait(self, timeout: timedelta) -> Communicator | None:
        """The communicator, once joined (None for a one-stage pipeline).

        Raises:
            TimeoutError: Not every stage joined within ``timeout``.
            RuntimeError: Joining failed (the message says why).
        """
        with self._lock:
            future, prefix = self._future, self.prefix
        try:
            return future.result(timeout=max(0.0, timeout.total_seconds()))
        except FutureTimeout:
            raise TimeoutError(
                f"stage {self.rank}: the pipeline communicator ({self.backend}, prefix {prefix!r}) was not "
                f"ready within {timeout.total_seconds():.1f}s; are all {self.world_size} stages assigned "
                "with this prefix?") from None
        except Exception as exc:
            raise RuntimeError(f"stage {self.rank}: the pipeline communicator under {prefix!r} could not be "
                               f"built: {type(exc).__name__}: {exc}") from exc

    def close(self) -> None:
        """Close the communicator (or the one still joining, once it is built) and the registry client."""
        with self._lock:
            self._closed = True
            future = self._future
        _close(future)
        if self._registry is not None:
            self._registry.close()


def _close(future: Future[Communicator | None]) -> None:
    if future.done() and future.exception() is None:
        comm = future.result()
        if comm is not None:
            comm.close()
