"""The coordinator's heap during a run: what was there when the stages were placed is never scanned again.

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
collections skip: they scan only what the steps allocated since. The young generations are collected as
usual, so a step's own cyclic garbage is found as before. The cost is that cyclic garbage among the
frozen objects (garbage already, or garbage later) is not freed while they stay frozen: :func:`release`
(when the runtime closes: before a recovery places another, and at the end of a session) unfreezes
them, so the next full collection frees it, and a frozen heap never outlives its runtime. No collection
is forced at the freeze: it would cost the placement a full scan (0.1-0.3 s).

``gc.unfreeze`` gives back the whole permanent generation: it cannot tell the runtime's objects from
those the user's program froze itself (``gc.freeze()`` before ``Job.fit``, as servers do before they
fork). So a heap that was already frozen when the runtime settled is left frozen at release: the
user's frozen objects stay where the user put them, and the runtime's join them until the user's own
``gc.unfreeze()``.
"""

from __future__ import annotations

import gc

__all__ = ["release", "settle"]


_froze = False  # settle() froze a heap nobody had frozen: release() may unfreeze it


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
