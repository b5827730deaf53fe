"""The cutter: exact against brute force, fast on long chains, better than the even split, pluggable."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
import time
from typing import cast

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.planning.cutting import (
    CUTTERS,
    CutError,
    CutProblem,
    _range_max,
    _run_maxima,
    cut_even,
    cut_min_max,
    fits_memory,
    get_cutter,
    register_cutter,
    with_slack,
)
from tests.unit.coordinator.planning.cut_paths import PATHS, on_path


def brute_force(problem: CutProblem) -> float:
    """The best slowest-stage time over every feasible cut (inf if none)."""
    n, k = problem.num_nodes, problem.num_stages
    best = math.inf
    for inner in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *inner, n)
        try:
            problem.check(bounds)
        except CutError:
            continue
        pace = problem.pace or (1.0,) * k
        best = min(best, max(sum(problem.compute_s[a:b]) * pace[s] + (problem.cut_s[a] if a > 0 else 0)
                             + (problem.cut_s[b] if b < n else 0)
                             for s, (a, b) in enumerate(itertools.pairwise(bounds))))
    return best


@st.composite
def problems(draw: st.DrawFn, memory: bool) -> CutProblem:
    n = draw(st.integers(1, 12))
    k = draw(st.integers(1, min(4, n)))
    cost = st.floats(0, 10, allow_nan=False)
    compute = tuple(draw(st.lists(cost, min_size=n, max_size=n)))
    cuts = tuple(draw(st.lists(st.floats(0, 5), min_size=n + 1, max_size=n + 1)))
    cuttable = None
    if draw(st.booleans()):
        cuttable = tuple(draw(st.lists(st.booleans(), min_size=n + 1, max_size=n + 1)))
    pace = None  # stages on workers of other speeds ([Note: a stage's pace]): a few speeds, or any
    if draw(st.booleans()):
        speeds = st.sampled_from([1.0, 0.5, 2 / 3, 0.8]) | st.floats(0.05, 1.0)
        pace = tuple(draw(st.lists(speeds, min_size=k, max_size=k)))
    if not memory:
        return CutProblem(compute, cuts, k, cuttable, pace=pace)
    static = tuple(draw(st.lists(st.floats(0, 10), min_size=n, max_size=n)))
    act = tuple(draw(st.lists(st.floats(0, 3), min_size=n, max_size=n)))
    in_flight = tuple(draw(st.lists(st.integers(1, 4), min_size=k, max_size=k)))
    limit = tuple(draw(st.lists(st.floats(5, 60), min_size=k, max_size=k)))
    return CutProblem(compute, cuts, k, cuttable, static, act, in_flight, limit, pace=pace)


def assert_exact(problem: CutProblem) -> None:
    """The cutter's slowest stage is the brute force's, on the band and on the compiled programme."""
    best = brute_force(problem)
    for path in PATHS:
        with on_path(path):
            if math.isinf(best):
                with pytest.raises(CutError):
                    cut_min_max(problem)
                continue
            bounds = cut_min_max(problem)
            problem.check(bounds)
            assert problem.max_stage_time(bounds) == pytest.approx(best, rel=1e-9, abs=1e-9)


@settings(max_examples=400, deadline=None)
@given(problem=problems(memory=False))
def test_min_max_equals_brute_force(problem: CutProblem) -> None:
    assert_exact(problem)


@settings(max_examples=400, deadline=None)
@given(problem=problems(memory=True))
def test_min_max_equals_brute_force_under_memory_limits(problem: CutProblem) -> None:
    assert_exact(problem)


@st.composite
def memory_problems(draw: st.DrawFn) -> CutProblem:
    """Problems under memory limits with every memory term the cutter sums: deferred bytes on deferring
    stages, held weight-gradient rows on holding ones."""
    base = draw(problems(memory=True))
    n, k = base.num_nodes, base.num_stages
    extra: dict[str, object] = {}
    if draw(st.booleans()):
        extra["deferred_bytes"] = tuple(draw(st.lists(st.floats(0, 4), min_size=n, max_size=n)))
        extra["defers"] = tuple(draw(st.lists(st.booleans(), min_size=k, max_size=k)))
    if draw(st.booleans()):
        extra["hold_bytes"] = tuple(draw(st.lists(st.floats(0, 6), min_size=n, max_size=n)))
        extra["holds"] = tuple(draw(st.lists(st.booleans(), min_size=k, max_size=k)))
    if draw(st.booleans()):  # ZeRO-3's gathered parameters: the most of the stage's nodes
        extra["transient_bytes"] = tuple(draw(st.lists(st.floats(0, 20), min_size=n, max_size=n)))
    return dataclasses.replace(base, **extra)  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(values=st.lists(st.floats(0, 1e6), min_size=1, max_size=40), data=st.data())
def test_range_max_is_the_most_over_each_range(values: list[float], data: st.DataObject) -> None:
    n = len(values)
    ends = np.array(data.draw(st.lists(st.integers(0, n), min_size=1, max_size=20)), dtype=np.int64)
    starts = np.array([data.draw(st.integers(0, int(e))) for e in ends], dtype=np.int64)
    got = _range_max(_run_maxima(np.array(values)), starts, ends)
    assert got.tolist() == [max(values[a:b], default=0.0) for a, b in zip(starts, ends, strict=True)]


@settings(max_examples=600, deadline=None)
@given(problem=memory_problems())
def test_fits_memory_says_exactly_whether_some_cut_fits(problem: CutProblem) -> None:
    """[Note: a cut that cannot fit]: the O(k n) memory test against every cut."""
    n, k = problem.num_nodes, problem.num_stages
    some = False
    for inner in itertools.combinations(range(1, n), k - 1):
        try:
            problem.check((0, *inner, n))
        except CutError:
            continue
        some = True
        break
    assert fits_memory(problem) == some
    if not some:  # and the cutter refuses it without a search
        with pytest.raises(CutError, match="memory limits"):
            cut_min_max(problem)


def test_a_stage_exactly_at_its_memory_limit_fits() -> None:
    """Found by hypothesis: prefix sums put stage 1 at 6.914363438809985 against a limit of
    6.914363438809984 (the same sum taken directly); a rounding error must not make it infeasible."""
    problem = CutProblem((0.0,) * 4, (0.0,) * 5, 2, None, (0.0, 10.0, 1.9143634388099837, 5.0), (0.0,) * 4,
                         (1, 1), (10.0, 6.914363438809984))
    assert cut_min_max(problem) == (0, 2, 4)
    assert_exact(problem)


def test_thousand_nodes_into_sixteen_stages_under_a_second() -> None:
    rng = random.Random(7)
    n = 1000
    problem = CutProblem(tuple(rng.lognormvariate(0, 1) for _ in range(n)),
                         tuple(rng.uniform(0, 0.5) for _ in range(n + 1)), 16)
    cut_min_max(problem)  # warm numpy up
    t0 = time.perf_counter()
    bounds = cut_min_max(problem)
    elapsed = time.perf_counter() - t0
    print(f"\n1,000 nodes -> 16 stages: {elapsed * 1e3:.1f} ms")
    assert elapsed < 1.0
    assert len(bounds) == 17
    assert problem.max_stage_time(bounds) <= problem.max_stage_time(cut_even(problem))


def test_min_max_beats_even_split_on_very_uneven_chain() -> None:
    # 24 nodes: mostly cheap, a few 50x heavier ones clustered at the end (a head / large layers),
    # with activations that shrink along the chain (cheap cuts late, expensive ones early)
    compute = tuple([1.0] * 16 + [50.0, 1.0, 50.0, 1.0, 50.0, 1.0, 50.0, 1.0])
    cuts = tuple(max(0.1, 4.0 - 0.2 * c) for c in range(25))
    problem = CutProblem(compute, cuts, 4)
    even = problem.max_stage_time(cut_even(problem))
    best = problem.max_stage_time(cut_min_max(problem))
    ratio = even / best
    print(f"\nuneven chain: even split slowest stage {even:.1f}, min-max {best:.1f}, ratio {ratio:.2f}x")
    assert ratio > 1.5


def test_even_split_sizes_and_uncuttable_positions() -> None:
    problem = CutProblem((1.0,) * 10, (0.0,) * 11, 3)
    assert cut_even(problem) == (0, 4, 7, 10)
    blocked = CutProblem((1.0,) * 10, (0.0,) * 11, 3, tuple(c != 4 for c in range(11)))
    assert cut_even(blocked) == (0, 3, 7, 10)


def test_check_names_the_problem() -> None:
    problem = CutProblem((1.0,) * 4, (0.0,) * 5, 2, (True, True, False, True, True),
                         (5.0,) * 4, (1.0,) * 4, (2, 1), (100.0, 8.0))
    with pytest.raises(CutError, match="are not 0 = b0"):
        problem.check((0, 4))
    with pytest.raises(CutError, match="cannot be cut"):
        problem.check((0, 2, 4))
    with pytest.raises(CutError, match=r"stage 1 \(nodes 1..3\) needs 18 bytes, its limit is 8"):
        problem.check((0, 1, 4))
    assert problem.check((0, 3, 4)) == (0, 3, 4)


def test_bad_problems_are_refused() -> None:
    with pytest.raises(ValueError, match="between 1 and"):
        CutProblem((1.0,), (0.0, 0.0), 2)
    with pytest.raises(ValueError, match="n \\+ 1 cut costs"):
        CutProblem((1.0, 1.0), (0.0,), 1)
    with pytest.raises(ValueError, match="needs static_bytes"):
        CutProblem((1.0,), (0.0, 0.0), 1, memory_limit=(1.0,))


def test_cutters_are_pluggable_by_name_or_callable() -> None:
    assert get_cutter("minmax") is cut_min_max and get_cutter("even") is cut_even

    def first_heavy(problem: CutProblem) -> tuple[int, ...]:
        return (0, *range(problem.num_nodes - problem.num_stages + 1, problem.num_nodes + 1))

    assert get_cutter(first_heavy) is first_heavy
    register_cutter("first-heavy", first_heavy)
    try:
        assert get_cutter("first-heavy")(CutProblem((1.0,) * 5, (0.0,) * 6, 3)) == (0, 3, 4, 5)
    finally:
        del CUTTERS["first-heavy"]
    with pytest.raises(ValueError, match="registered: minmax, even"):
        get_cutter("nope")


def test_a_faster_stage_takes_more_nodes() -> None:
    """[Note: a stage's pace]: nine equal nodes over a stage of pace 1 and one twice as fast (pace 0.5): 3
    and 6 nodes, 3 s each, where equal paces split them 4 and 5 (5 s)."""
    nine = (1.0,) * 9
    assert cut_min_max(CutProblem(nine, (0.0,) * 10, 2)) == (0, 4, 9)
    paced = CutProblem(nine, (0.0,) * 10, 2, pace=(1.0, 0.5))
    assert cut_min_max(paced) == (0, 3, 9) and paced.max_stage_time((0, 3, 9)) == 3.0
    assert paced.stage_time(3, 9, 1) == 3.0 and paced.stage_time(3, 9) == 6.0  # stage 0's pace unless named
    # transfers are the link's: a pace does not scale them
    assert CutProblem(nine, (0.0,) + (1.0,) * 8 + (0.0,), 2, pace=(1.0, 0.5)).stage_time(3, 9, 1) == 4.0


@pytest.mark.parametrize("pace", [(1.0,), (1.0, 0.0), (1.0, -0.5, 1.0)])
def test_a_pace_per_stage_and_positive(pace: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match="pace needs one positive entry per stage"):
        CutProblem((1.0,) * 6, (0.0,) * 7, len(pace) + (len(pace) == 1), pace=pace)


def by_hand(extra: dict[str, object], static: tuple[float, ...], act: tuple[float, ...], in_flight: int,
            s: int, a: int, b: int) -> float:
    """A stage's bytes from the problem's raw terms, written out here: its nodes' static bytes; per
    microbatch in flight, each node's activations or (a deferring stage) the larger of those and its deferred
    bytes; its largest transient; a holding stage's held rows."""
    deferred = cast("tuple[float, ...] | None", extra.get("deferred_bytes"))
    defers = cast("tuple[bool, ...] | None", extra.get("defers"))
    held = act
    if deferred is not None and defers is not None and defers[s]:
        held = tuple(max(x, y) for x, y in zip(act, deferred, strict=True))
    need = math.fsum(static[a:b]) + math.fsum(held[a:b]) * in_flight
    transient = cast("tuple[float, ...] | None", extra.get("transient_bytes"))
    if transient is not None:
        need += max(transient[a:b])
    hold = cast("tuple[float, ...] | None", extra.get("hold_bytes"))
    holds = cast("tuple[bool, ...] | None", extra.get("holds"))
    if hold is not None and holds is not None and holds[s]:
        need += math.fsum(hold[a:b])
    return need


@pytest.mark.parametrize("seed", range(30))
def test_check_decides_as_the_sums_node_by_node(seed: int) -> None:
    """``CutProblem.check`` over every memory term (deferring and holding stages, transients) refuses exactly
    the cuts whose stage's bytes, written out by hand (:func:`by_hand`), exceed its limit with slack: limits
    drawn right at a stage's bytes, a hair under and a hair over them (the nudges of 1e-12 fall within the
    slack and the rounding alike; those of 1e-6 and more decide)."""
    rng = random.Random(21000 + seed)
    n = rng.randint(4, 60)
    k = rng.randint(1, min(8, n))
    static = tuple(rng.uniform(0, 3) for _ in range(n))
    act = tuple(rng.uniform(0, 1) for _ in range(n))
    in_flight = tuple(rng.randint(1, 5) for _ in range(k))
    extra: dict[str, object] = {}
    if seed % 2:
        extra["transient_bytes"] = tuple(rng.uniform(0, 2) for _ in range(n))
    if seed % 3 == 1:
        extra["deferred_bytes"] = tuple(rng.uniform(0, 2) for _ in range(n))
        extra["defers"] = tuple(rng.random() < 0.5 for _ in range(k))
    if seed % 3 == 2:
        extra["hold_bytes"] = tuple(rng.uniform(0, 1) for _ in range(n))
        extra["holds"] = tuple(rng.random() < 0.5 for _ in range(k))
    bounds = (0, *sorted(rng.sample(range(1, n), k - 1)), n)
    base = CutProblem((1.0,) * n, (0.0,) * (n + 1), k, None, static, act, in_flight, (1.0,) * k,
                      **extra)  # type: ignore[arg-type]
    needs = [by_hand(extra, static, act, in_flight[s], s, a, b)
             for s, (a, b) in enumerate(itertools.pairwise(bounds))]
    assert needs == pytest.approx([base.stage_memory(s, a, b)
                                   for s, (a, b) in enumerate(itertools.pairwise(bounds))], rel=1e-12)
    for nudge in (0.0, -1e-12, 1e-12, -1e-6, 1e-6, -0.3, 0.3):
        limits = tuple(need * (1 + nudge) + rng.choice([0.0, nudge]) for need in needs)
        problem = dataclasses.replace(base, memory_limit=limits)
        over = [s for s in range(k) if needs[s] > with_slack(limits[s])]
        if over:
            with pytest.raises(CutError, match=f"stage {over[0]} "):
                problem.check(bounds)
        else:
            assert problem.check(bounds) == bounds


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_problem_with_a_time_not_finite_is_refused_clearly(bad: float) -> None:
    """A node's or a cut's time of inf or NaN is refused where the problem is made, naming it, rather than
    failing later as a chain that cannot be cut."""
    compute = [1.0] * 20
    compute[7] = bad
    with pytest.raises(ValueError, match="finite"):
        CutProblem(tuple(compute), (0.0,) * 21, 4)
    cuts = [0.1] * 21
    cuts[5] = bad
    with pytest.raises(ValueError, match="finite"):
        CutProblem((1.0,) * 20, tuple(cuts), 4)
