"""The process's heap (comm/heap.py): frozen while a run or a search goes on, then given back."""

from __future__ import annotations

import gc
import weakref

from comm.heap import frozen, release, settle


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


def test_a_frozen_block_skips_what_was_there_and_gives_it_back() -> None:
    old = _Node()
    gone_old = weakref.ref(old)
    with frozen():
        assert gc.get_freeze_count() > 0
        del old
        young = _Node()  # made in the block: still collected by the block's own collections
        gone_young = weakref.ref(young)
        del young
        gc.collect()
        assert gone_young() is None
        assert gone_old() is not None  # frozen: skipped
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert gone_old() is None


def test_a_frozen_block_inside_a_settled_heap_leaves_it_settled() -> None:
    try:
        settle()
        before = gc.get_freeze_count()
        with frozen():
            pass
        assert gc.get_freeze_count() >= before  # the run's freeze is the run's to release
    finally:
        release()
    assert gc.get_freeze_count() == 0
