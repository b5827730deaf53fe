"""Every registered schedule, as data, on stages 2..8 and microbatches 1..32 (wherever it allows the pair).

Checked here with code of its own, not the validator's: each stage runs every microbatch's forward
before its backward (``W`` after ``I``), every send has its receive, played with eager sends and
blocking receives no rank waits forever, and the activations held stay within each schedule's
documented bound. Interleaved 1F1B is checked for every chunk count that divides the stages.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import pytest

from coordinator.planning.schedules import (
    CHUNKED,
    SCHEDULES,
    Schedule,
    build_schedule,
    interleaved_group,
    schedule_problem,
)
from services.protocol import Action

STAGES = range(2, 9)
MICROBATCHES = range(1, 33)


def shapes(name: str, p: int) -> list[tuple[int, int]]:
    """(chunks, microbatches) the schedule allows on ``p`` stages."""
    chunks = [v for v in range(2, p + 1) if p % v == 0] if name in CHUNKED else [1]
    return [(v, m) for v in chunks for m in MICROBATCHES if schedule_problem(name, p, m, v) is None]


def held_bound(name: str, p: int, m: int, v: int, rank: int) -> int:
    """The most microbatches of activations rank ``rank`` may hold (each schedule's docstring)."""
    if name == "gpipe":
        return m
    if name == "1f1b":
        return min(p - rank, m)
    if name == "zb-h1":
        return min(p, m)
    ranks = p // v
    g = interleaved_group(ranks, m)
    assert g is not None
    return min((v - 1) * g + 2 * (ranks - 1 - rank) + 1, v * m)  # Megatron's: warm-up + 1


def peak_held(order: Sequence[Action]) -> int:
    """Activations are held from F to B, or to W when the backward is split."""
    held = peak = 0
    for a in order:
        held += {"F": 1, "B": -1, "W": -1}.get(a.kind, 0)
        peak = max(peak, held)
    return peak


def never_runs(orders: Sequence[Sequence[Action]]) -> list[Action]:
    """Play the ranks' orders, a receive blocking until its send ran; the first action of each stuck rank."""
    sent: set[tuple[int, str, int]] = set()  # (to stage, kind received, microbatch)
    pos = [0] * len(orders)
    moved = True
    while moved:
        moved = False
        for r, order in enumerate(orders):
            while pos[r] < len(order):
                a = order[pos[r]]
                if a.kind.startswith("RECV") and (a.stage, a.kind, a.microbatch) not in sent:
                    break
                if a.kind == "SEND_F":
                    sent.add((a.stage + 1, "RECV_F", a.microbatch))
                elif a.kind == "SEND_B":
                    sent.add((a.stage - 1, "RECV_B", a.microbatch))
                pos[r] += 1
                moved = True
    return [order[k] for order, k in zip(orders, pos, strict=True) if k < len(order)]


def check(sched: Schedule, name: str, p: int, m: int, v: int) -> None:
    where = f"{name} p={p} m={m} chunks={v}"
    assert sched.num_stages == p and sched.num_microbatches == m, where
    ranks = p // v
    assert sched.num_ranks == ranks, where
    orders = [sched.rank_actions(r) for r in range(ranks)]
    for r, order in enumerate(orders):
        assert sorted({a.stage for a in order}) == list(range(r, p, ranks)), where  # rank r: r, r + R, ...
    for s, acts in enumerate(sched.actions):
        assert acts == tuple(a for a in orders[s % ranks] if a.stage == s), where
        pos = {(a.kind, a.microbatch): k for k, a in enumerate(acts)}
        assert len(pos) == len(acts), f"{where}: stage {s} repeats an action"
        for i in range(m):
            f = pos[("F", i)]
            if ("B", i) in pos:
                assert f < pos[("B", i)], f"{where}: stage {s} runs B{i} before F{i}"
                assert ("I", i) not in pos and ("W", i) not in pos, where
            else:
                assert f < pos[("I", i)] < pos[("W", i)], f"{where}: stage {s}, microbatch {i}: F < I < W"
        counts = Counter(a.kind for a in acts)
        assert counts["F"] == m and counts["B"] + counts["W"] == m, where
    transfers = Counter((a.stage, a.kind, a.microbatch) for acts in sched.actions for a in acts
                        if a.peer is not None)
    for (s, kind, i), n in transfers.items():  # every send has exactly one receive on its peer, and back
        peer = s + 1 if kind in ("SEND_F", "RECV_B") else s - 1
        other = {"SEND_F": "RECV_F", "RECV_F": "SEND_F", "SEND_B": "RECV_B", "RECV_B": "SEND_B"}[kind]
        assert n == 1 and transfers[(peer, other, i)] == 1, f"{where}: {s}{kind}{i} has no other end"
    assert not never_runs(orders), f"{where}: deadlock at {never_runs(orders)}"
    for r, order in enumerate(orders):
        assert peak_held(order) <= held_bound(name, p, m, v, r), f"{where}: rank {r} holds too much"


@pytest.mark.parametrize("p", STAGES)
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_schedule_keeps_its_rules_and_bounds(name: str, p: int) -> None:
    allowed = shapes(name, p)
    assert allowed, f"{name} allows no shape on {p} stages"
    for v, m in allowed:
        check(build_schedule(name, p, m, v), name, p, m, v)


@pytest.mark.parametrize("p", STAGES)
def test_interleaved_allows_exactly_the_counts_that_split_into_groups(p: int) -> None:
    for v in (v for v in range(2, p + 1) if p % v == 0):
        ranks = p // v
        for m in MICROBATCHES:
            allowed = schedule_problem("interleaved-1f1b", p, m, v) is None
            assert allowed == (m % max(1, m // ranks) == 0), (p, v, m)
            if m % ranks == 0:  # Megatron's rule: always allowed, in groups of R
                assert allowed and interleaved_group(ranks, m) == ranks
            if not allowed:
                with pytest.raises(ValueError, match=f"use a multiple of {ranks}"):
                    build_schedule("interleaved-1f1b", p, m, v)


def test_interleaved_bubble_is_1f1b_on_as_many_workers_shrunk_by_the_chunks() -> None:
    from coordinator.planning.simulator import StageCosts, simulate

    for ranks, v, m in ((2, 2, 4), (4, 2, 8), (2, 4, 6), (3, 2, 3)):
        p = ranks * v
        one = simulate(build_schedule("1f1b", ranks, m), StageCosts.uniform(ranks, 1.0, 2.0))
        chunked = simulate(build_schedule("interleaved-1f1b", p, m, v),
                           StageCosts.uniform(p, 1.0 / v, 2.0 / v))
        assert one.bubble_fraction == pytest.approx((ranks - 1) / (m + ranks - 1))
        assert chunked.bubble_fraction == pytest.approx((ranks - 1) / (v * m + ranks - 1))
        assert chunked.step_time_s == pytest.approx(3.0 * (m + (ranks - 1) / v))


def test_chunks_are_refused_where_they_mean_nothing() -> None:
    assert "use interleaved-1f1b" in str(schedule_problem("1f1b", 4, 4, 2))
    assert "chunks >= 2" in str(schedule_problem("interleaved-1f1b", 4, 4, 1))
    assert "multiple of 2, not 5" in str(schedule_problem("interleaved-1f1b", 5, 4, 2))
    with pytest.raises(ValueError, match=r"num_microbatches=5 .* use a multiple of 2 .* \[3, 4, 6\]"):
        build_schedule("interleaved-1f1b", 4, 5, 2)


def test_interleaved_prints_its_ranks_and_parses_back() -> None:
    sched = build_schedule("interleaved-1f1b", 4, 4, 2)
    text = str(sched)
    assert text.splitlines()[5].startswith("rank 0 (0,2): 0F0 0SEND_F0 0F1 0SEND_F1 2RECV_F0 2F0 ")
    assert Schedule.parse(text) == sched
    assert sched.ranks == ((0, 2), (1, 3)) and sched.rank_of(3) == 1 and sched.stages_of(0) == (0, 2)
