"""Watches on etcd that survive etcd restarts: one bidirectional ``Watch`` stream per watch.

[Note: resuming etcd watches]
An :class:`EtcdWatch` runs its stream in a daemon thread and remembers the revision of
the last event it delivered. On any error or end of the stream (etcd restarted, the
connection dropped) it reconnects, with exponential backoff bounded by
:class:`WatchRetry`, and re-creates the watch at ``last revision + 1``. etcd sends
whole revisions in one response (we never ask for fragmented responses), so resuming
after the last delivered revision loses and repeats nothing. If etcd stays unreachable
longer than ``give_up_after``, or the revision to resume from was compacted, the
watch fails: :meth:`EtcdWatch.get` raises :class:`RegistryError`.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import grpc

from comm.errors import RegistryError
from comm.registry.base import EventType, Watch, WatchEvent
from comm.registry.etcd_grpc import etcdrpc, prefix_end, status_name

__all__ = ["EtcdWatch", "WatchRetry"]

logger = logging.getLogger(__name__)

_WATCH_QUEUE = 10_000  # events buffered per watch before the stream is back-pressured


@dataclass(frozen=True, slots=True)
class WatchRetry:
    """How a broken watch stream is re-established.

    Attributes:
        initial: the wait before the first reconnect attempt; doubled after each failure.
        maximum: the longest wait between attempts.
        give_up_after: how long etcd may stay unreachable before the watch fails.
    """

    initial: timedelta = timedelta(milliseconds=50)
    maximum: timedelta = timedelta(seconds=1)
    give_up_after: timedelta = timedelta(seconds=60)


class _WatchFailed(Exception):
    """The watch cannot continue (compacted revision): deliver the error and stop."""

    def __init__(self, error: RegistryError) -> None:
        super().__init__(str(error))
        self.error = error


class EtcdWatch(Watch):
    """An etcd watch that survives etcd restarts (see [Note: resuming etcd watches]).

    Attributes:
        reconnects: how many times the stream was re-established after a failure.
    """

    def __init__(
        self,
        open_stream: Callable[[Iterator[Any]], Any],
        endpoint: str,
        prefix: str,
        start_revision: int,
        retry: WatchRetry,
    ) -> None:
        """Start watching ``prefix`` from ``start_revision``.

        Args:
            open_stream: opens one ``Watch`` RPC over the registry's channel (the requests
                in, a cancellable iterator of responses out); called once per attempt.
            endpoint: etcd's address, for messages.
        """
        self._open_stream = open_stream
        self._endpoint = endpoint
        self._prefix = prefix
        self._key = prefix.encode() or b"\0"
        self._range_end = prefix_end(prefix.encode())
        self._next = start_revision  # the revision to (re)start the stream at
        self._retry = retry
        self._queue: queue.Queue[WatchEvent | RegistryError] = queue.Queue(maxsize=_WATCH_QUEUE)
        self._error: RegistryError | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._call: Any = None
        self._stream_done: threading.Event | None = None
        self._established_once = False
        self._failing_since: float | None = None
        self.reconnects = 0
        self._thread = threading.Thread(target=self._run, name=f"etcd-watch-{prefix}", daemon=True)
        self._thread.start()

    def get(self, timeout: timedelta) -> WatchEvent | None:
        """The next event, or None if none arrived within ``timeout``.

        Raises:
            RegistryError: the watch was cancelled, its revision was compacted, or etcd
                stayed unreachable longer than ``WatchRetry.give_up_after``.
        """
        if self._error is not None:
            raise self._error
        if self._stop.is_set():
            raise RegistryError(f"the watch on {self._prefix!r} was cancelled")
        try:
            item = self._queue.get(timeout=max(0.0, timeout.total_seconds()))
        except queue.Empty:
            return None
        if isinstance(item, RegistryError):
            self._error = item
            raise item
        return item

    def cancel(self) -> None:
        """Stop the stream and its thread (bounded: 5 s). Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        with contextlib.suppress(queue.Full):  # a get() waiting in another thread returns now, cancelled
            self._queue.put_nowait(RegistryError(f"the watch on {self._prefix!r} was cancelled"))
        with self._lock:
            call, done = self._call, self._stream_done
        if done is not None:
            done.set()
        if call is not None:
            call.cancel()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    # -- the watch thread --------------------------------------------------------------

    def _run(self) -> None:
        backoff = self._retry.initial.total_seconds()
        while not self._stop.is_set():
            try:
                self._stream_once()
                reason = "the stream ended"
            except _WatchFailed as exc:
                self._deliver(exc.error)
                return
            except grpc.RpcError as exc:
                reason = status_name(exc)[1]
            except Exception as exc:  # anything else from gRPC: reconnect all the same
                reason = f"{type(exc).__name__}: {exc}"
            if self._stop.is_set():
                return
            now = time.monotonic()
            if self._failing_since is None:
                self._failing_since = now
                backoff = self._retry.initial.total_seconds()
                logger.warning(
                    "etcd watch on %r at %s lost (%s); resuming from revision %d",
                    self._prefix,
                    self._endpoint,
                    reason,
                    self._next,
                )
            elif now - self._failing_since > self._retry.give_up_after.total_seconds():
                self._deliver(
                    RegistryError(
                        f"etcd watch on {self._prefix!r}: etcd at {self._endpoint} unreachable "
                        f"for {self._retry.give_up_after.total_seconds():.0f}s (last: {reason}); "
                        f"the watch stopped before revision {self._next}"
                    )
                )
                return
            if self._stop.wait(backoff):
                return
            backoff = min(backoff * 2, self._retry.maximum.total_seconds())

    def _stream_once(self) -> None:
        done = threading.Event()
        create = etcdrpc.WatchCreateRequest(
            key=self._key, range_end=self._range_end, start_revision=self._next
        )

        def requests() -> Iterator[Any]:
            yield etcdrpc.WatchRequest(create_request=create)
            done.wait()  # keep our side open until this stream attempt ends

        # No deadline: the stream lives until cancel() or an error; no wait_for_ready, so
        # an unreachable etcd fails the attempt at once and the backoff loop paces retries.
        call = self._open_stream(requests())
        with self._lock:
            self._call, self._stream_done = call, done
        try:
            if self._stop.is_set():
                return
            for response in call:
                self._on_response(response)
        finally:
            done.set()
            call.cancel()
            with self._lock:
                self._call = self._stream_done = None

    def _on_response(self, response: Any) -> None:
        if response.compact_revision:
            raise _WatchFailed(
                RegistryError(
                    f"etcd watch on {self._prefix!r}: revision {self._next} is compacted "
                    f"(etcd keeps revisions from {response.compact_revision}); re-read with list() "
                    "and watch from revision() + 1"
                )
            )
        if response.created:
            if self._established_once:
                self.reconnects += 1
                logger.info("etcd watch on %r re-established at revision %d", self._prefix, self._next)
            self._established_once = True
            self._failing_since = None
        if response.canceled:
            raise RuntimeError(f"etcd cancelled the watch: {response.cancel_reason or 'no reason given'}")
        for event in response.events:
            kv = event.kv
            deleted = event.type == etcdrpc.kv_pb2.Event.DELETE
            self._deliver(
                WatchEvent(
                    EventType.DELETE if deleted else EventType.PUT,
                    kv.key.decode(),
                    b"" if deleted else bytes(kv.value),
                    int(kv.mod_revision),
                )
            )
            self._next = int(kv.mod_revision) + 1

    def _deliver(self, item: WatchEvent | RegistryError) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:  # the consumer is behind: hold the stream (gRPC flow control)
                continue
