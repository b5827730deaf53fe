"""The banded min-max cutter and its compiled programme give the very boundaries of the dense programme."""

from __future__ import annotations

import contextlib
import math
import random
import time

import numpy as np
import pytest
from hypothesis import given, settings

from coordinator.planning.cutting import (
    CutError,
    CutProblem,
    _banded,
    _least_relaxed,
    cut_min_max,
    with_slack,
)
from tests.unit.coordinator.planning.cut_paths import PATHS, compiled_at, on_each_path, on_path
from tests.unit.coordinator.planning.test_cutting import problems


def dense_min_max(problem: CutProblem) -> tuple[int, ...]:
    """The dense O(k n^2) programme (the cutter before the band): every start for every end."""
    n, k = problem.num_nodes, problem.num_stages
    prefix = problem._prefix
    w = np.asarray(problem.cut_s, dtype=np.float64).copy()
    w[0] = w[n] = 0.0
    spent = prefix[None, :] - prefix[:, None]
    idx = np.arange(n + 1)
    invalid = idx[None, :] <= idx[:, None]
    if problem.cuttable is not None:
        allowed = np.asarray(problem.cuttable, dtype=bool).copy()
        allowed[0] = allowed[n] = True
        invalid |= ~allowed[:, None] | ~allowed[None, :]
    pace = problem.pace or (1.0,) * k

    def compute_cost(s: int) -> np.ndarray:  # ((P_j - P_i) * pace + w_i) + w_j, as stage_time sums it
        return np.where(invalid, np.inf, spent * pace[s] + w[:, None] + w[None, :])
    mem_static = None
    if problem.memory_limit is not None:
        assert problem.static_bytes is not None
        ps = np.concatenate([[0.0], np.cumsum(problem.static_bytes)])
        mem_static = ps[None, :] - ps[:, None]
        if problem.transient_bytes is not None and any(problem.transient_bytes):
            top = np.zeros((n + 1, n + 1))
            for i in range(n):
                top[i, i + 1:] = np.maximum.accumulate(np.asarray(problem.transient_bytes[i:]))
            mem_static = mem_static + top

    def stage_cost(s: int) -> np.ndarray:
        held = problem.held_bytes(s)
        cost = compute_cost(s)
        if mem_static is None or held is None:
            return cost
        pa = np.concatenate([[0.0], np.cumsum(held)])
        assert problem.memory_limit is not None and problem.in_flight is not None
        static = mem_static
        if problem.holds is not None and problem.holds[s] and problem.hold_bytes is not None \
                and any(problem.hold_bytes):  # a stage holding weight-gradient rows
            ph = np.concatenate([[0.0], np.cumsum(problem.hold_bytes)])
            static = mem_static + (ph[None, :] - ph[:, None])
        over = static + (pa[None, :] - pa[:, None]) * problem.in_flight[s] > with_slack(
            problem.memory_limit[s])
        return np.where(over, np.inf, cost)

    best = stage_cost(0)[0].copy()
    choice = np.zeros((k, n + 1), dtype=np.int64)
    for s in range(1, k):
        cand = np.maximum(best[:, None], stage_cost(s))
        choice[s] = np.argmin(cand, axis=0)
        best = cand[choice[s], idx]
    if not math.isfinite(best[n]):
        raise CutError("infeasible")
    bounds = [n]
    for s in range(k - 1, 0, -1):
        bounds.append(int(choice[s][bounds[-1]]))
    bounds.append(0)
    return tuple(reversed(bounds))


def same_as_dense(problem: CutProblem) -> None:
    """The band's and the compiled programme's boundaries are the dense programme's (or all find none)."""
    try:
        expected = dense_min_max(problem)
    except CutError:
        for path in PATHS:
            with on_path(path), pytest.raises(CutError):
                cut_min_max(problem)
        return
    assert on_each_path(lambda: cut_min_max(problem)) == [expected, expected]


@settings(max_examples=300, deadline=None)
@given(problem=problems(memory=True))
def test_the_band_gives_the_dense_boundaries_under_memory_limits(problem: CutProblem) -> None:
    same_as_dense(problem)


@settings(max_examples=300, deadline=None)
@given(problem=problems(memory=False))
def test_the_band_gives_the_dense_boundaries(problem: CutProblem) -> None:
    same_as_dense(problem)


@pytest.mark.parametrize("seed", range(12))
def test_long_uneven_chains_with_memory_and_ties(seed: int) -> None:
    """Longer chains than hypothesis draws: heavy nodes, equal nodes (ties), tight memory, transients."""
    rng = random.Random(seed)
    n = rng.choice([40, 90, 150])
    k = rng.choice([2, 5, 16, 33])
    kind = seed % 3
    compute = [1.0] * n if kind == 0 else [rng.choice([0.0, 0.5, 1.0, 8.0]) for _ in range(n)]
    cuts = [rng.choice([0.0, 0.01, 0.3]) for _ in range(n + 1)]
    cuttable = tuple(rng.random() > 0.1 for _ in range(n + 1))
    static = tuple(rng.uniform(0, 4) for _ in range(n))
    act = tuple(rng.uniform(0, 1) for _ in range(n))
    in_flight = tuple(rng.randint(1, 4) for _ in range(k))
    limit = tuple(rng.uniform(1.2, 3.0) * sum(static) / k for _ in range(k))
    transient = tuple(rng.uniform(0, 2) for _ in range(n)) if seed % 2 else None
    pace = tuple(rng.choice([1.0, 0.5, 0.8, rng.uniform(0.1, 1)]) for _ in range(k)) if seed % 4 > 1 else None
    same_as_dense(CutProblem(tuple(compute), tuple(cuts), k, cuttable, pace=pace))
    same_as_dense(CutProblem(tuple(compute), tuple(cuts), k, cuttable, static, act, in_flight, limit,
                             transient_bytes=transient, pace=pace))


@pytest.mark.parametrize("seed", range(40))
def test_one_to_six_stages_with_every_memory_term(seed: int) -> None:
    """The first stage's and the last stage's rows (the programme builds no band for one or two stages)
    against the dense programme: transients, deferring and holding stages, cuttable positions, ties."""
    rng = random.Random(1000 + seed)
    for _ in range(10):
        n = rng.randint(1, 30)
        k = rng.randint(1, min(6, n))
        compute = tuple(rng.choice([0.0, 1.0, rng.uniform(0, 5)]) for _ in range(n))
        cuts = tuple(rng.choice([0.0, 0.2, rng.uniform(0, 2)]) for _ in range(n + 1))
        cuttable = tuple(rng.random() > 0.2 for _ in range(n + 1)) if rng.random() < 0.5 else None
        static = tuple(rng.uniform(0, 4) for _ in range(n))
        act = tuple(rng.uniform(0, 1) for _ in range(n))
        in_flight = tuple(rng.randint(1, 4) for _ in range(k))
        limit = tuple(rng.uniform(0.8, 3.0) * (sum(static) + sum(act)) / k for _ in range(k))
        extra: dict[str, object] = {}
        if rng.random() < 0.5:
            extra["transient_bytes"] = tuple(rng.uniform(0, 2) for _ in range(n))
        if rng.random() < 0.5:
            extra["deferred_bytes"] = tuple(rng.uniform(0, 2) for _ in range(n))
            extra["defers"] = tuple(rng.random() < 0.5 for _ in range(k))
        if rng.random() < 0.5:
            extra["hold_bytes"] = tuple(rng.uniform(0, 1) for _ in range(n))
            extra["holds"] = tuple(rng.random() < 0.5 for _ in range(k))
        same_as_dense(CutProblem(compute, cuts, k, cuttable, static, act, in_flight, limit,
                                 **extra))  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", range(16))
def test_the_ends_window_with_flat_runs_and_stages_alike_in_memory(seed: int) -> None:
    """[Note: the ends' window]: long runs of free nodes (a flat compute sum at a window's edge), dear
    cuts, and stages that share their memory terms (GPipe's: one mask for all) or not (1F1B's in-flight
    counts), against the dense programme."""
    rng = random.Random(5000 + seed)
    n = rng.choice([60, 120, 240])
    k = rng.choice([3, 4, 7, 12, 30])
    compute: list[float] = []
    while len(compute) < n:
        compute += [0.0] * rng.randint(1, 12) if rng.random() < 0.4 else [rng.choice([0.5, 1.0, 3.0])]
    compute = compute[:n]
    cuts = tuple(rng.choice([0.0, 0.05, 0.5, 2.0]) for _ in range(n + 1))
    cuttable = tuple(rng.random() > 0.15 for _ in range(n + 1)) if seed % 2 else None
    static = tuple(rng.uniform(0, 4) for _ in range(n))
    act = tuple(rng.uniform(0, 1) for _ in range(n))
    room = rng.uniform(1.1, 2.5) * (sum(static) + 2 * sum(act)) / k
    alike = seed % 4 < 2
    in_flight = tuple(2 if alike else k - s for s in range(k))
    # two generations of workers: the second half of the stages twice as fast ([Note: a stage's pace])
    pace = tuple(1.0 if s < k // 2 else 0.5 for s in range(k)) if seed % 3 == 0 else None
    for problem in (CutProblem(tuple(compute), cuts, k, cuttable, pace=pace),
                    CutProblem(tuple(compute), cuts, k, cuttable, static, act, in_flight, (room,) * k,
                               pace=pace)):
        same_as_dense(problem)
        with contextlib.suppress(CutError):  # the band at the answer itself: no room to spare
            dense = dense_min_max(problem)
            optimum = problem.max_stage_time(dense)
            assert _banded(problem, optimum)[0] == dense
            assert compiled_at(problem, optimum) == dense


@pytest.mark.parametrize("seed", range(24))
def test_cuts_bound_by_memory_give_the_dense_boundaries(seed: int) -> None:
    """[Note: a cut bound by memory] and [Note: a stage's own band]: 1F1B's in-flight counts (the first
    stage holds ``k`` microbatches, the last one) and limits that leave the first stages a few nodes each,
    so the optimum sits well over the compute's share; with transients, holding stages, deferring stages
    and uncuttable positions now and then. The boundaries are the dense programme's, and the relaxed bound
    the tries start from is never above the optimum."""
    rng = random.Random(9000 + seed)
    n = rng.choice([60, 150, 300])
    k = rng.choice([3, 4, 6, 9, 14, 40])
    compute = tuple(rng.uniform(0.2, 5.0) for _ in range(n))
    cuts = tuple(rng.choice([0.0, 0.01, 0.2]) for _ in range(n + 1))
    cuttable = tuple(rng.random() > 0.1 for _ in range(n + 1)) if seed % 3 == 0 else None
    static = tuple(rng.uniform(0, 1) for _ in range(n))
    act = tuple(rng.uniform(0.1, 4.0) for _ in range(n))
    in_flight = tuple(k - s for s in range(k))
    # room for 1 to 3 times a first stage of n / k nodes' activations alone: the first stages get fewer
    room = rng.uniform(0.3, 1.0) * k * sum(act) / k
    extra: dict[str, object] = {}
    if seed % 4 == 1:
        extra["transient_bytes"] = tuple(rng.uniform(0, 3) for _ in range(n))
    if seed % 4 == 2:
        extra["hold_bytes"] = tuple(rng.uniform(0, 1) for _ in range(n))
        extra["holds"] = tuple(s % 2 == 0 for s in range(k))
    if seed % 4 == 3:
        extra["deferred_bytes"] = tuple(rng.uniform(0, 6) for _ in range(n))
        extra["defers"] = tuple(s < k // 2 for s in range(k))
    pace = tuple(rng.choice([1.0, 0.5]) for _ in range(k)) if seed % 5 == 0 else None
    problem = CutProblem(compute, cuts, k, cuttable, static, act, in_flight, (room,) * k, pace=pace,
                         **extra)  # type: ignore[arg-type]
    same_as_dense(problem)
    with contextlib.suppress(CutError):
        optimum = problem.max_stage_time(dense_min_max(problem))
        share = sum(compute) / k * min(pace or (1.0,))
        assert share <= _least_relaxed(problem, share) <= optimum


def test_a_thousand_nodes_into_128_stages_is_fast() -> None:
    rng = random.Random(0)
    compute = tuple(rng.uniform(0.5, 1.5) for _ in range(1000))
    problem = CutProblem(compute, tuple([0.01] * 1001), 128)
    t0 = time.perf_counter()
    bounds = cut_min_max(problem)
    took = time.perf_counter() - t0
    assert bounds == dense_min_max(problem)
    print(f"\n1,000 nodes into 128 stages: {took * 1e3:.1f} ms")


@pytest.mark.parametrize("seed", range(8))
def test_far_apart_paces_over_flat_runs_give_the_dense_boundaries(seed: int) -> None:
    """[Note: a stage's pace] with [Note: the ends' window]: stages up to 20x apart in pace, many of them,
    over chains with long runs of free nodes (where a window's edge rounded the wrong way would skip a
    whole run), with and without memory limits, against the dense programme."""
    rng = random.Random(7000 + seed)
    n, k = rng.choice([120, 240]), rng.choice([9, 24, 60])
    compute: list[float] = []
    while len(compute) < n:
        compute += [0.0] * rng.randint(1, 15) if rng.random() < 0.5 else [rng.choice([0.1, 1.0, 7.0])]
    compute = compute[:n]
    cuts = tuple(rng.choice([0.0, 0.01, 0.3]) for _ in range(n + 1))
    pace = tuple(rng.choice([1.0, 0.05, rng.uniform(0.05, 1.0)]) for _ in range(k))
    static = tuple(rng.uniform(0, 4) for _ in range(n))
    act = tuple(rng.uniform(0, 1) for _ in range(n))
    room = rng.uniform(1.2, 3.0) * (sum(static) + sum(act)) / k
    for problem in (CutProblem(tuple(compute), cuts, k, None, pace=pace),
                    CutProblem(tuple(compute), cuts, k, None, static, act, (1,) * k, (room,) * k, pace=pace)):
        same_as_dense(problem)
        with contextlib.suppress(CutError):  # the band at the answer itself: no room to spare
            dense = dense_min_max(problem)
            assert _banded(problem, problem.max_stage_time(dense))[0] == dense
            assert compiled_at(problem, problem.max_stage_time(dense)) == dense


@pytest.mark.parametrize("seed", range(12))
def test_dear_cuts_over_many_stages_give_the_dense_boundaries(seed: int) -> None:
    """[Note: the ends' window, with the cuts paid]: cuts that cost as much as a stage's compute or more,
    nearly alike (the cheapest cuts are nearly the ones paid: the window has little to spare), many stages
    of a few nodes each, paces and uncuttable positions now and then, against the dense programme, and the
    band at the answer itself."""
    rng = random.Random(11000 + seed)
    n = rng.choice([80, 160])
    k = rng.choice([n // 8, n // 4, n // 2])
    compute = tuple(rng.uniform(0.1, 1.0) for _ in range(n))
    dear = rng.choice([0.5, 2.0, 8.0])  # a cut against a node's mean compute of 0.55
    cuts = tuple(dear * rng.uniform(1.0, 1.0 + rng.choice([0.0, 0.02, 0.3])) for _ in range(n + 1))
    cuttable = tuple(rng.random() > 0.1 for _ in range(n + 1)) if seed % 3 == 0 else None
    pace = tuple(rng.choice([1.0, 0.5]) for _ in range(k)) if seed % 2 else None
    problem = CutProblem(compute, cuts, k, cuttable, pace=pace)
    same_as_dense(problem)
    with contextlib.suppress(CutError):
        dense = dense_min_max(problem)
        assert _banded(problem, problem.max_stage_time(dense))[0] == dense
        assert compiled_at(problem, problem.max_stage_time(dense)) == dense


@pytest.mark.parametrize("seed", range(24))
def test_the_cut_within_memory_is_the_cut_ignoring_it_where_that_fits(seed: int) -> None:
    """[Note: memory binding, cut within it at once] in planner.py: where the min-max cut ignoring memory
    fits the limits, the min-max cut within them is that very cut (ties included: flat runs, alike cuts),
    so the search may cut within memory at once; where it does not fit, the cut within memory differs."""
    rng = random.Random(13000 + seed)
    n, k = rng.choice([40, 90]), rng.choice([2, 3, 5, 9, 16])
    compute: list[float] = []
    while len(compute) < n:
        compute += [0.0] * rng.randint(1, 6) if rng.random() < 0.3 else [rng.choice([0.5, 1.0, rng.random()])]
    compute = compute[:n]
    cuts = tuple(rng.choice([0.0, 0.1, 0.1, 0.4]) for _ in range(n + 1))
    static = tuple(rng.uniform(0, 2) for _ in range(n))
    act = tuple(rng.uniform(0, 1) for _ in range(n))
    in_flight = tuple(k - s for s in range(k)) if seed % 2 else (2,) * k
    pace = tuple(rng.choice([1.0, 0.5]) for _ in range(k)) if seed % 3 == 0 else None
    free = cut_min_max(CutProblem(tuple(compute), cuts, k, None, pace=pace))
    fitted = missed = 0
    for scale in (0.6, 0.9, 1.2, 2.0, 5.0):
        room = scale * (sum(static) + max(in_flight) * sum(act)) / k
        problem = CutProblem(tuple(compute), cuts, k, None, static, act, in_flight, (room,) * k, pace=pace)
        try:
            within = cut_min_max(problem)
        except CutError:
            continue
        try:
            problem.check(free)
        except CutError:
            missed += 1
            continue
        fitted += 1
        assert within == free, (scale, within, free)
    assert fitted + missed > 0



@pytest.mark.parametrize("seed", range(6))
def test_cluster_sized_chains_give_the_band_s_boundaries_compiled(seed: int) -> None:
    """[Note: the compiled programme] in compiled_cut.py at the size it is for (1,000 nodes into up to 256
    stages, as the search cuts on a cluster's list): every memory term, two or three paces, dear cuts or
    cheap ones, against the band (the dense programme at this size is the band's own tests' business)."""
    rng = random.Random(17000 + seed)
    n, k = 1000, rng.choice([16, 64, 128, 256])
    compute = tuple(rng.uniform(0.2, 2.0) * (8.0 if rng.random() < 0.01 else 1.0) for _ in range(n))
    dear = rng.choice([0.001, 0.3, 2.0])
    cuts = tuple(dear * rng.uniform(0.5, 1.5) for _ in range(n + 1))
    pace = tuple(rng.choice([1.0, 0.7, 0.4]) for _ in range(k)) if seed % 2 else None
    static = tuple(rng.uniform(0, 1) for _ in range(n))
    act = tuple(rng.uniform(0.1, 2.0) for _ in range(n))
    in_flight = tuple(min(k - s, 16) for s in range(k))
    room = rng.uniform(0.6, 2.0) * (sum(static) + 4 * sum(act)) / k
    extra: dict[str, object] = {}
    if seed % 3 == 1:
        extra["transient_bytes"] = tuple(rng.uniform(0, 3) for _ in range(n))
        extra["hold_bytes"] = tuple(rng.uniform(0, 1) for _ in range(n))
        extra["holds"] = tuple(s % 2 == 0 for s in range(k))
    if seed % 3 == 2:
        extra["deferred_bytes"] = tuple(rng.uniform(0, 3) for _ in range(n))
        extra["defers"] = tuple(s < k // 2 for s in range(k))
    for problem in (CutProblem(compute, cuts, k, None, pace=pace),
                    CutProblem(compute, cuts, k, None, static, act, in_flight, (room,) * k, pace=pace,
                               **extra)):  # type: ignore[arg-type]
        found: list[tuple[int, ...] | None] = []
        for path in PATHS:
            with on_path(path):
                try:
                    found.append(cut_min_max(problem))
                except CutError:
                    found.append(None)
        assert found[0] == found[1]


def test_without_numba_the_band_cuts_every_chain(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where numba cannot be imported, ``cut_min_max`` still cuts a long chain (on the band), exactly."""
    from coordinator.planning import compiled_cut

    rng = random.Random(3)
    problem = CutProblem(tuple(rng.uniform(0.5, 1.5) for _ in range(300)), (0.01,) * 301, 32)
    with on_path("compiled"):
        expected = cut_min_max(problem)
    monkeypatch.setattr(compiled_cut, "_kernels", None)
    monkeypatch.setattr(compiled_cut, "_unavailable", "ImportError: no numba here")
    assert not compiled_cut.available()
    assert cut_min_max(problem) == expected


def test_a_process_loads_numba_only_once_the_band_spent_its_budget() -> None:
    """[Note: the band first, then the compiled programme]: long chains go to the band, and numba is not
    imported, until the band has spent ``BAND_BUDGET_S`` of CPU on them; then the compiled programme cuts
    them, with the same boundaries."""
    import subprocess
    import sys

    script = """
import random, sys
from coordinator.planning import compiled_cut
from coordinator.planning.cutting import CutProblem, cut_min_max
compiled_cut.BAND_BUDGET_S = 0.05
rng = random.Random(0)
problems = [CutProblem(tuple(rng.uniform(0.5, 1.5) for _ in range(400)), (0.01,) * 401, 24)
            for _ in range(40)]
cuts = [cut_min_max(p) for p in problems]
assert "numba" not in sys.modules, "numba imported for the first long chains"
for _ in range(5000):  # the band's tries until it has spent its budget (a few ms a cut)
    if compiled_cut._band_spent >= compiled_cut.BAND_BUDGET_S:
        break
    cut_min_max(problems[0])
assert "numba" not in sys.modules and compiled_cut._band_spent < 1.0
cuts.append(cut_min_max(problems[-1]))
assert "numba" in sys.modules, "the band spent its budget and numba was still not imported"
problems.append(problems[-1])
compiled_cut.BAND_BUDGET_S = float("inf")
compiled_cut._kernels = None
assert [cut_min_max(p) for p in problems] == cuts
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
