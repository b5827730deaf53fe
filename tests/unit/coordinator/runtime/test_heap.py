"""The coordinator's heap while a runtime runs (coordinator/runtime/heap.py): frozen, then given back."""

from __future__ import annotations

import gc
import weakref

from coordinator.runtime.heap import release, settle


class _Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the cyclic collector frees it


def test_a_settled_heap_is_skipped_until_released() -> None:
    node = _Node()
    gone = weakref.ref(node)
    try:
        settle()
        assert gc.get_freeze_count() > 0
        young = len(gc.get_objects())
        del node
        gc.collect()
        assert gone() is not None  # frozen: a collection does not look at it
        assert young < gc.get_freeze_count()  # collections scan what came after, not the frozen heap
    finally:
        release()
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert gone() is None  # given back: the next collection frees it


def test_a_heap_the_program_froze_itself_stays_frozen() -> None:
    mine = _Node()
    gone = weakref.ref(mine)
    gc.freeze()  # the program's own freeze, before the run
    try:
        before = gc.get_freeze_count()
        settle()
        release()
        assert gc.get_freeze_count() >= before  # the program's frozen objects were not given back
        del mine
        gc.collect()
        assert gone() is not None
    finally:
        gc.unfreeze()
    gc.collect()
    assert gone() is None
