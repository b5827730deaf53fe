"""The process's heap (comm/heap.py): frozen while a run or a search goes on, then given back."""

from __future__ import annotations

import gc
import weakref

import pytest

from comm import heap
from comm.heap import frozen, release, scheduled, settle, tidy


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


def test_a_session_s_steps_collect_young_garbage_once_the_heap_grew_and_everything_now_and_then(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Within scheduled() the automatic collector is off; tidy() collects the young generations once the
    tracked containers grew by YOUNG_GROWTH (cyclic garbage counts: it is never freed by reference counting),
    and the old ones once FULL_EVERY_S passed; then it is on again."""
    assert gc.isenabled()
    generations: list[int] = []

    def seen(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            generations.append(info["generation"])

    gc.callbacks.append(seen)
    monkeypatch.setattr(heap, "YOUNG_GROWTH", 3000)
    try:
        with scheduled():
            assert not gc.isenabled()
            old = _Node()  # garbage later, once it has grown old
            gone_old = weakref.ref(old)
            gc.collect(1)  # old now: in the oldest generation, where only a full collection looks
            del old
            few = [_Node() for _ in range(100)]  # cyclic garbage, far from the threshold: it waits
            gone_few = weakref.ref(few[0])
            del few
            generations.clear()
            tidy()
            assert generations == [] and gone_few() is not None
            kept = [[k] for k in range(5000)]  # a request's replies, kept a while: the heap grows
            tidy()
            assert generations == [1] and gone_few() is None and gone_old() is not None
            del kept  # freed by reference counting, as newer replies take their place
            for _ in range(3):  # requests whose containers live and die between two collections
                kept = [[k] for k in range(5000)]
                del kept
                tidy()
            assert generations == [1]  # nothing grew: nothing was scanned
            monkeypatch.setattr(heap, "FULL_EVERY_S", 0.0)  # as if a minute had passed
            tidy()
            assert generations == [1, 2] and gone_old() is None
        assert gc.isenabled()
        generations.clear()
        tidy()  # outside: nothing (the automatic collector runs)
        assert generations == []
    finally:
        gc.callbacks.remove(seen)


def test_a_collector_the_program_turned_off_stays_off_and_untouched() -> None:
    gc.disable()
    try:
        collected: list[int] = []
        gc.callbacks.append(cb := lambda phase, info: collected.append(info["generation"]))
        try:
            with scheduled():
                tidy()
        finally:
            gc.callbacks.remove(cb)
        assert collected == [] and not gc.isenabled()
    finally:
        gc.enable()
