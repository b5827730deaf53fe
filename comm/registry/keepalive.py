"""Keeping a lease alive through registry outages.

[Note: registry outages]
A holder keeps its lease with a :class:`KeepAlive`: a daemon thread refreshes it every
``ttl / 3``. When the registry does not answer (etcd stopped, restarting or cut off; a served
registry whose process is gone), the refresh is retried every :data:`RETRY` for as long as it
takes: a KeepAlive never gives up by itself, and the holder decides what an unreachable
registry means (:meth:`KeepAlive.unreachable_for`; a worker whose embedded registry is
silent for a whole lease concludes that its coordinator, which served it, is gone).

When the registry answers again, the lease may be gone: it expired on the server while the
holder could not refresh it (etcd revokes every lease whose TTL passed while it was stopped
the moment it resumes; a partitioned etcd expires them on time). A holder that can publish
again (``renew``) then gets a new lease of the same TTL and puts its keys again: the same
keys, the same values, a new lease. A holder without ``renew`` is :attr:`KeepAlive.lost`.

So after an outage every holder's keys may vanish and come back. A watcher that reads a
vanished key as "that process died" must not take the outage's deletions for deaths:
:class:`comm.registry.follow.Follower` holds a deletion seen while the registry is *in
doubt* (:meth:`KeepAlive.in_doubt`: it did not answer, or answered late or with a lost
lease, within the last :data:`OUTAGE_GRACE`) and reports it only if the key is not back
within :data:`OUTAGE_GRACE`. Away from outages a deletion is reported at once, so a dead
process is noticed as fast as its lease lapses.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta

from comm.errors import LeaseExpiredError
from comm.logs import LogThrottle
from comm.registry.base import Lease

__all__ = ["OUTAGE_GRACE", "RETRY", "KeepAlive"]

log = logging.getLogger(__name__)

RETRY = timedelta(seconds=0.5)
"""The longest wait between attempts while the registry does not answer (or a lease must be renewed)."""

OUTAGE_GRACE = timedelta(seconds=5)
"""How long after a registry outage a vanished key is suspected of being the outage's doing, and how
long it then has to come back (its holder re-publishing it) before it counts as gone."""

HELD_BACK_LOG_WINDOW = timedelta(seconds=10)
"""At most one line per kind (ran late, took long) per lease in this window; the rest are counted."""


def _more(held: int) -> str:
    return f" ({held} more since the last such line)" if held else ""


Renew = Callable[[], Lease]
"""Grant a new lease and put the holder's keys again with it; return the new lease."""


class KeepAlive:
    """Refreshes a lease from a daemon thread every ``interval`` (``ttl / 3``) until stopped.

    The period counts from the start of each refresh, so a slow answer does not stretch it: the
    registry receives a refresh every ``interval`` while each takes less than that.

    See [Note: registry outages]. A refresh the registry does not answer is retried every
    :data:`RETRY` (at most ``interval``), forever. When the registry answers that the lease is
    gone, ``renew`` (if given) is called until it succeeds and :attr:`lease` becomes the lease it
    returns; without ``renew``, :attr:`lost` is set and the thread ends.

    Args:
        lease: the lease to keep (its keys are already put).
        renew: grants a new lease and re-puts the holder's keys with it (on this thread).
        interval: between refreshes (default: a third of the lease's TTL).
        what: names the holder's keys in the log line of a renewal ("worker w0's card").

    Attributes:
        lost: set when the lease is gone and there is no ``renew``.
        renewals: how many times the lease was renewed after it was gone.
    """

    def __init__(self, lease: Lease, *, renew: Renew | None = None, interval: timedelta | None = None,
                 what: str = "the keys") -> None:
        self._lease = lease
        self._renew = renew
        self.what = what
        self.interval = (interval or lease.ttl / 3).total_seconds()
        self.lost = threading.Event()
        self.renewals = 0
        self._lock = threading.Lock()
        self._answered = time.monotonic()  # when the registry last answered (the grant counts)
        self._asking_since: float | None = None  # the start of the attempt in flight
        self._failing = False  # the last attempt got no answer
        self._doubted_at: float | None = None  # the last time the registry was silent, late or lost the lease
        self._expired = False  # the registry said the lease is gone: renew it
        self._stop = threading.Event()
        self._throttle = LogThrottle(HELD_BACK_LOG_WINDOW.total_seconds())  # used by the thread alone
        self._thread = threading.Thread(target=self._run, name=f"keepalive-{lease.id}", daemon=True)
        self._thread.start()

    @property
    def lease(self) -> Lease:
        """The lease kept now (a new one after each renewal)."""
        return self._lease

    def unreachable_for(self) -> float:
        """Seconds since the registry last answered, while it does not answer; 0.0 while it does.

        The registry "does not answer" when the last attempt failed without an answer, or the
        attempt in flight has taken longer than ``interval`` (a frozen holder that resumes finds its
        attempt answered at once, so it never reads as an outage).
        """
        with self._lock:
            now = time.monotonic()
            if self._failing or self._stuck(now):
                return now - self._answered
            return 0.0

    def in_doubt(self, within: timedelta = OUTAGE_GRACE) -> bool:
        """Whether the registry is silent now, or was silent, late or lost this lease within ``within``."""
        with self._lock:
            now = time.monotonic()
            if self._failing or self._stuck(now):
                return True
            return self._doubted_at is not None and now - self._doubted_at <= within.total_seconds()

    def stop(self, *, revoke: bool = False) -> None:
        """Stop refreshing (and revoke the lease, best effort: it lapses by itself anyway)."""
        self._stop.set()
        self._thread.join(timeout=5)
        if revoke:
            with contextlib.suppress(Exception):
                self._lease.revoke()

    # -- the thread --------------------------------------------------------------------

    def _stuck(self, now: float) -> bool:
        return self._asking_since is not None and now - self._asking_since > self.interval

    def _run(self) -> None:
        wait = self.interval
        while True:
            due = time.monotonic() + wait
            if self._stop.wait(wait) or self.lost.is_set():
                return
            late = time.monotonic() - due
            if late > self.interval and (held := self._throttle.admit("late")) is not None:
                log.warning("lease %s of %s: the refresh ran %.2fs late (its thread was not scheduled: the "
                            "process is starved of CPU or a thread held the GIL); the lease's TTL is %.1fs%s",
                            f"{self._lease.id:#x}", self.what, late, self._lease.ttl.total_seconds(),
                            _more(held))
            wait = self._attempt()

    def _attempt(self) -> float:
        """One refresh (or renewal); returns the wait before the next attempt."""
        retry = min(self.interval, RETRY.total_seconds())
        started = time.monotonic()
        with self._lock:
            self._asking_since = started
        try:
            if self._expired:
                assert self._renew is not None
                old, self._lease = self._lease, self._renew()
                self.renewals += 1
                log.info("the registry lost lease %s of %s while it could not be refreshed; published them "
                         "again with lease %s", f"{old.id:#x}", self.what, f"{self._lease.id:#x}")
            else:
                self._lease.refresh()
        except LeaseExpiredError:
            self._done(answered=True, doubt=True)
            if self._renew is None:
                self.lost.set()
                return 0.0
            self._expired = True
            return 0.0
        except Exception as exc:  # unreachable, timed out, refused: retry; the holder decides what it means
            log.debug("lease %s: no answer from the registry (%s); retrying", f"{self._lease.id:#x}", exc)
            self._done(answered=False, doubt=True)
            return retry
        self._expired = False
        took = time.monotonic() - started
        if took > self.interval and (held := self._throttle.admit("took")) is not None:
            log.warning("lease %s of %s: a refresh took %.2fs (the registry answered slowly, or this thread "
                        "did not run meanwhile: the process starved of CPU or a thread held the GIL); the "
                        "lease's TTL is %.1fs%s", f"{self._lease.id:#x}", self.what, took,
                        self._lease.ttl.total_seconds(), _more(held))
        self._done(answered=True, doubt=took > self.interval)
        return max(0.0, self.interval - took)  # paced from each send: a slow answer keeps the period

    def _done(self, *, answered: bool, doubt: bool) -> None:
        with self._lock:
            now = time.monotonic()
            self._asking_since = None
            self._failing = not answered
            if answered:
                self._answered = now
            if doubt:
                self._doubted_at = now
