"""``stage_kinds``: the per-stage kinds the planner prices backwards by, as the built lists have them."""

from __future__ import annotations

from collections import Counter

import pytest

from coordinator.planning.schedules import (
    SCHEDULES,
    UNSPLIT_CHUNKED,
    schedule_problem,
    schedule_steps,
    stage_kind_counts,
    stage_kinds,
)

COMPUTE = ("F", "B", "I", "W")


@pytest.mark.parametrize("name", sorted(UNSPLIT_CHUNKED))
def test_an_unsplit_chunked_schedule_runs_each_microbatch_once_unsplit(name: str) -> None:
    """The closed form stage_kinds gives without building: every stage m forwards and m whole backwards."""
    shapes = [(p, m, v) for p in range(2, 17) for m in (1, 2, 3, 4, 8, 16, 32) for v in (2, 3, 4)
              if schedule_problem(name, p, m, v) is None]
    assert len(shapes) > 50
    for p, m, v in shapes:
        built = schedule_steps(name, p, m, v)[1]
        assert len(built) == p
        for s, steps in enumerate(built):
            counts = Counter(step.kind for step in steps if step.kind in COMPUTE)
            assert counts == {"F": m, "B": m}, (p, m, v, s, counts)
        assert [Counter(k for k in kinds if k in COMPUTE) for kinds in stage_kinds(name, p, m, v)] == [
            Counter({"F": m, "B": m})] * p


@pytest.mark.parametrize("name", sorted(set(SCHEDULES) - UNSPLIT_CHUNKED))
def test_other_schedules_give_their_lists_kinds_in_order(name: str) -> None:
    for p in (1, 2, 3, 5, 8, 16):
        for m in (1, 2, 4, 7, 16, 64):
            if schedule_problem(name, p, m, 1) is not None:
                continue
            assert stage_kinds(name, p, m) == tuple(tuple(step.kind for step in steps)
                                                    for steps in schedule_steps(name, p, m)[1])


def test_a_refused_shape_is_refused_the_same_way() -> None:
    with pytest.raises(ValueError) as closed:
        stage_kinds("interleaved-1f1b", 3, 4, 1)
    with pytest.raises(ValueError) as built:
        schedule_steps("interleaved-1f1b", 3, 4, 1)
    assert str(closed.value) == str(built.value)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1", *sorted(UNSPLIT_CHUNKED)])
def test_the_closed_counts_are_the_built_lists(name: str) -> None:
    """``stage_kind_counts``: per stage, the ``B``, ``I`` and ``W`` of the list ``schedule_steps`` builds."""
    chunks = (2, 3, 4) if name in UNSPLIT_CHUNKED else (1,)
    checked = 0
    for p in (1, 2, 3, 4, 6, 8, 12):
        for m in (1, 2, 3, 4, 7, 8, 16):
            for v in chunks:
                stages = p * v
                if schedule_problem(name, stages, m, v) is not None:
                    continue
                counts = stage_kind_counts(name, stages, m, v)
                lists = schedule_steps(name, stages, m, v)[1]
                built = [Counter(step.kind for step in steps) for steps in lists]
                assert counts == tuple((c["B"], c["I"], c["W"]) for c in built), (name, stages, m, v)
                checked += 1
    assert checked > 20
    assert stage_kind_counts("no such schedule", 2, 2) is None


def test_zb_h1_products_are_its_lists() -> None:
    """The planner's ZB-H1 products without the list are ``_split_products`` of the list itself: every
    stage, microbatch count, replicas or none, and held limit crossed at every count."""
    from coordinator.planning.planner import _split_products, _zb_h1_products

    for p in range(1, 10):
        for m in range(1, 13):
            kinds = stage_kinds("zb-h1", p, m)
            for s in range(p):
                for alone in (False, True):
                    for crossing in range(m + 2):
                        assert _zb_h1_products(s, m, alone, crossing) == _split_products(
                            kinds[s], alone, crossing), (p, m, s, alone, crossing)
