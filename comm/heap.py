"""The process's heap and the cyclic collector: what a long computation or a run never scans again.

Three uses, one mechanism (``gc.freeze``): a coordinator's run (:func:`settle` once its stages are
placed, :func:`release` when its runtime closes; the note below), one long computation that allocates
many containers, such as a plan search (:func:`frozen`, [Note: a search's collections]), and a worker's
imports, frozen for the process's life (:func:`settle_imports`, [Note: a worker's heap and its lease]).
And a session's steps collect on their own schedule, not the automatic collector's (:func:`scheduled`,
:func:`tidy`, [Note: a run's collections, on its own schedule]).

[Note: a full collection in the middle of a step]
CPython's cyclic garbage collector scans every tracked container of the process in its oldest
generation's collections, and the coordinator's process holds a few hundred thousand of them before
its first step (torch and its modules, the model it traced, the profile, the plan, the registry's
client). Its steps then allocate a few dozen containers per reply (the decoded maps and lists, the
messages, the records), so every so many steps a full collection falls in the middle of one: at 128
data-parallel hollow workers one full collection in 20 steps cost 164 ms of the coordinator's CPU (318,000
objects), 45 % of all it spent on those steps (docs/benchmarks.md "Hollow workers").

So once a runtime has placed its stages (:func:`settle`), the coordinator moves every tracked object
into the collector's permanent generation (``gc.freeze``, a splice of two lists: no scan), which
collections skip: they scan only what the steps allocated since. The young generations are still
collected (while ``fit`` trains, by :func:`tidy`: the next note), so a step's own cyclic garbage is
found as before. The cost is that cyclic garbage among the frozen objects (garbage already, or garbage
later) is not freed while they stay frozen: :func:`release` (when the runtime closes: before a recovery
places another, and at the end of a session) unfreezes them, so the next full collection frees it, and a
frozen heap never outlives its runtime. No collection is forced at the freeze: it would cost the
placement a full scan (0.1-0.3 s).

[Note: a run's collections, on its own schedule]
Frozen, the heap before the run costs nothing; what the steps keep still does. A request's replies and
records (a dozen containers a stage reply) outlive the young collections, so each is scanned by a young
collection, again by a middle one a few requests later, and then by the full collections CPython runs
each time its oldest generation grew by a quarter (the records of the latest steps:
``coordinator/runtime/records.py``): 15-20 us a reply, a quarter to a third of the coordinator's CPU at
64-256 data-parallel hollow workers (docs/benchmarks.md "Hollow workers"). So while a session trains
(:func:`scheduled`, around its steps, not around a recovery) the automatic collector is off and the
session collects on its own schedule, as torchtitan's trainer does (its ``gc_freq``): :func:`tidy` after
each request's records, never inside a step, and a full collection at most every :data:`FULL_EVERY_S`
seconds frees cyclic garbage that grew old first. Between two ``fit`` calls, the program's own code runs
with the automatic collector on. A program that had turned the collector off itself is left as it was.

[Note: a young collection when the heap grew]
A young collection after every request scanned each reply once (1 ms a request of 10 steps at 64
data-parallel hollow workers, 7% of the coordinator's CPU) and found nothing: in a settled run a
request's containers are the replies the run keeps ([Note: the detail a run keeps] in
``coordinator/runtime/records.py``), freed by reference counting once newer ones take their place, and
26 objects in cycles were found over 201 requests (docs/benchmarks.md, "2026-12-01, 05:35 UTC"). So
:func:`tidy` collects the young generations only once the tracked containers grew by
:data:`YOUNG_GROWTH` since the last collection (``gc.get_count()[0]``: containers made less containers
freed, CPython's own trigger, with a larger threshold and read only between requests). A settled run
grows by a few containers a step (its thinned records), so the replies that live and die between two
collections are never scanned; a run filling its kept detail grows by its replies, and each is scanned
about once, as before. Cyclic garbage is never freed by reference counting, so each of its containers
counts: at most :data:`YOUNG_GROWTH` of them wait for the next collection.

``gc.unfreeze`` gives back the whole permanent generation: it cannot tell the runtime's objects from
those the user's program froze itself (``gc.freeze()`` before ``Job.fit``, as servers do before they
fork). So a heap that was already frozen when the runtime settled is left frozen at release: the
user's frozen objects stay where the user put them, and the runtime's join them until the user's own
``gc.unfreeze()``.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator

__all__ = ["FULL_EVERY_S", "YOUNG_GROWTH", "frozen", "release", "scheduled", "settle", "settle_imports",
           "tidy"]

FULL_EVERY_S = 60.0  # within scheduled(), tidy() collects everything at most once in this many seconds
# within scheduled(), tidy() collects the young generations once the tracked containers grew by this many
# since the last collection ([Note: a young collection when the heap grew]): a few MB at most
YOUNG_GROWTH = 10_000

_froze = False  # settle() froze a heap nobody had frozen: release() may unfreeze it
_paused = False  # scheduled() turned the automatic collector off: tidy() collects meanwhile
_last_full = 0.0  # time.monotonic() of the last full collection tidy() made (or of the block's start)


def settle() -> None:
    """Freeze every tracked object (the next collections skip it); see the module docstring."""
    global _froze
    _froze = _froze or gc.get_freeze_count() == 0
    gc.freeze()


def release() -> None:
    """Unfreeze the heap: the next full collection scans (and frees) what the runtime left behind; a heap
    the program had frozen before the runtime settled stays frozen (module docstring)."""
    global _froze
    if _froze:
        gc.unfreeze()
    _froze = False


@contextlib.contextmanager
def scheduled() -> Iterator[None]:
    """Within the block (a session's steps) the automatic collector is off and :func:`tidy` collects
    ([Note: a run's collections, on its own schedule]); a collector the program turned off stays off."""
    global _paused, _last_full
    if not gc.isenabled() or _paused:
        yield
        return
    gc.disable()
    _paused, _last_full = True, time.monotonic()
    try:
        yield
    finally:
        _paused = False
        gc.enable()


def tidy() -> None:
    """The collection after each request's records within :func:`scheduled` ([Note: a run's collections,
    on its own schedule]): everything not frozen once :data:`FULL_EVERY_S` passed since the last full one,
    else the young generations once the heap grew by :data:`YOUNG_GROWTH` containers ([Note: a young
    collection when the heap grew]), else nothing. Nothing outside it (the automatic collector runs then)."""
    global _last_full
    if not _paused:
        return
    now = time.monotonic()
    if now - _last_full >= FULL_EVERY_S:
        _last_full = now
        gc.collect()
    elif gc.get_count()[0] >= YOUNG_GROWTH:
        gc.collect(1)


@contextlib.contextmanager
def frozen() -> Iterator[None]:
    """Within the block, collections skip every object tracked at its start.

    [Note: a search's collections]
    A plan search on a cluster's resource list allocates a few hundred thousand containers, and enough
    of them outlive the young collections to trigger full ones: on 1,024 workers one or two, each
    scanning the whole heap the process held before the search (200,000-300,000 objects with torch,
    numpy and pydantic loaded: 0.17 s of a 1.3 s search, 0.34 s of a 4.6 s one). Frozen at the start,
    that heap is skipped and a full collection scans the search's own objects. The young collections
    run as usual, so the search's cyclic garbage is still freed.

    A heap that was frozen already (a settled run re-planning after a loss, or the program's own
    freeze) is left as it is at the end; otherwise the block gives back what it froze
    (``gc.unfreeze``: a splice of two lists, no scan) and the next full collection may look at it again.
    """
    froze = gc.get_freeze_count() == 0
    gc.freeze()
    try:
        yield
    finally:
        if froze:
            gc.unfreeze()


def settle_imports() -> None:
    """Move every object the process holds now (its imports) into the collector's permanent generation.

    [Note: a worker's heap and its lease]
    A worker's lease is refreshed by a thread every ``ttl / 3``, and a thread runs only while it
    holds the GIL. A full garbage collection holds the GIL from start to end, and with torch and
    ``torch._dynamo`` loaded a worker's heap holds about 270,000 tracked containers: one full
    collection takes 0.2 s on an idle core and was seen taking 1.5 s on a loaded one, inside
    :class:`~comm.memcap.PeakProbe`'s collection as a stage was built. That starved the refresh past the
    lease (2 s in the tests, lapsing after 1.3 s without a refresh), so the coordinator took a healthy
    worker for dead while it placed the stages, with the embedded registry and with etcd alike.

    So once the runtime's libraries are loaded (before the lease is granted) the heap is frozen
    (``gc.freeze``: no scan, a splice of lists), and later collections scan only what the worker's
    assignments allocated: a collection in the probe then takes microseconds. Garbage among the
    imports' objects is never freed, which costs nothing that matters: the libraries stay loaded for
    the process's life. A forked worker inherits its fork server's frozen heap and freezes its own
    cellmesh imports on top (``coordinator/runtime/forkserver.py``); the hollow fleet freezes its
    imports as a worker does, and so does the probe of a worker's runtime bytes
    (``coordinator/planning/runtime_bytes.py``).
    """
    gc.freeze()
