"""The simulator: the bubble formula, hand-worked timelines, activations held, the SVG timeline."""

from __future__ import annotations

import itertools
import random
import re
from collections.abc import Sequence
from pathlib import Path
from xml.etree import ElementTree

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.planning.schedules import Step, build_schedule, gpipe, one_f_one_b, zb_h1
from coordinator.planning.simulator import (
    Sharing,
    StageCosts,
    TimedAction,
    draw_timeline,
    play,
    simulate,
)


@settings(max_examples=60, deadline=None)
@given(p=st.integers(1, 6), m=st.integers(1, 12), f=st.floats(0.01, 10), b=st.floats(0.01, 10),
       name=st.sampled_from(["gpipe", "1f1b"]))
def test_bubble_matches_formula_for_equal_stages_and_free_transfers(p: int, m: int, f: float, b: float,
                                                                   name: str) -> None:
    result = simulate(build_schedule(name, p, m), StageCosts.uniform(p, f, b))
    assert result.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), rel=1e-9, abs=1e-12)
    assert result.step_time_s == pytest.approx((m + p - 1) * (f + b), rel=1e-9)


def _spans(played: Sequence[TimedAction]) -> list[tuple[str, float, float]]:
    return [(str(t.action), t.start, t.end) for t in played]


def test_gpipe_two_stages_two_microbatches_by_hand() -> None:
    # forward 1, backward 2, every transfer 0.5 (each end pays it, a receive waits for the send to end)
    result = simulate(gpipe(2, 2), StageCosts.uniform(2, 1.0, 2.0, 0.5))
    assert _spans(result.timeline[0]) == [
        ("0F0", 0, 1), ("0SEND_F0", 1, 1.5), ("0F1", 1.5, 2.5), ("0SEND_F1", 2.5, 3),
        ("0RECV_B0", 7, 7.5), ("0B0", 7.5, 9.5), ("0RECV_B1", 9.5, 10), ("0B1", 10, 12)]
    assert _spans(result.timeline[1]) == [
        ("1RECV_F0", 1.5, 2), ("1F0", 2, 3), ("1RECV_F1", 3, 3.5), ("1F1", 3.5, 4.5),
        ("1B0", 4.5, 6.5), ("1SEND_B0", 6.5, 7), ("1B1", 7, 9), ("1SEND_B1", 9, 9.5)]
    assert result.step_time_s == 12
    assert result.busy_s == (8, 8)
    assert result.idle_s == (4, 4)
    assert result.bubble_fraction == pytest.approx(8 / 24)
    assert result.peak_in_flight == (2, 2)


def test_1f1b_two_stages_two_microbatches_by_hand() -> None:
    result = simulate(one_f_one_b(2, 2), StageCosts.uniform(2, 1.0, 2.0, 0.5))
    assert _spans(result.timeline[1]) == [
        ("1RECV_F0", 1.5, 2), ("1F0", 2, 3), ("1B0", 3, 5), ("1SEND_B0", 5, 5.5),
        ("1RECV_F1", 5.5, 6), ("1F1", 6, 7), ("1B1", 7, 9), ("1SEND_B1", 9, 9.5)]
    assert _spans(result.timeline[0])[-4:] == [("0RECV_B0", 5.5, 6), ("0B0", 6, 8), ("0RECV_B1", 9.5, 10),
                                                ("0B1", 10, 12)]
    assert result.step_time_s == 12
    assert result.peak_in_flight == (2, 1)
    # held activations over time on stage 1: +1 at each forward's start, -1 at each backward's end
    assert result.held[1] == ((0, 0), (2, 1), (5, 0), (6, 1), (9, 0))


def test_zb_h1_two_stages_two_microbatches_by_hand() -> None:
    # forward 1, backward 2 split into I 1 and W 1 (the default half), transfers 0.5; W frees the activations
    result = simulate(zb_h1(2, 2), StageCosts.uniform(2, 1.0, 2.0, 0.5))
    assert _spans(result.timeline[1]) == [
        ("1RECV_F0", 1.5, 2), ("1F0", 2, 3), ("1I0", 3, 4), ("1SEND_B0", 4, 4.5), ("1RECV_F1", 4.5, 5),
        ("1F1", 5, 6), ("1I1", 6, 7), ("1SEND_B1", 7, 7.5), ("1W0", 7.5, 8.5), ("1W1", 8.5, 9.5)]
    assert _spans(result.timeline[0])[-6:] == [
        ("0RECV_B0", 4.5, 5), ("0I0", 5, 6), ("0W0", 6, 7), ("0RECV_B1", 7.5, 8), ("0I1", 8, 9),
        ("0W1", 9, 10)]
    assert result.step_time_s == 10  # 1F1B: 12
    assert result.held[1] == ((0, 0), (2, 1), (5, 2), (8.5, 1), (9.5, 0))
    assert result.peak_in_flight == (2, 2)


@settings(max_examples=60, deadline=None)
@given(p=st.integers(2, 6), m=st.integers(1, 12), f=st.floats(0.01, 10), b=st.floats(0.01, 10))
def test_zb_h1_beats_1f1b_and_matches_the_papers_bubble(p: int, m: int, f: float, b: float) -> None:
    costs = StageCosts.uniform(p, f, b)  # W unmeasured: half the backward
    zb, one = simulate(zb_h1(p, m), costs), simulate(one_f_one_b(p, m), costs)
    assert zb.bubble_fraction < one.bubble_fraction
    if m >= p and f >= b / 2:  # the paper's (p-1)(F + I - W) per rank, here I = W
        assert zb.step_time_s == pytest.approx(m * (f + b) + (p - 1) * f, rel=1e-9)


def test_weight_half_of_the_backward() -> None:
    costs = StageCosts((1.0, 1.0), (3.0, 2.0), (0.0,), (0.0,), weight_backward_s=(1.0, 2.0))
    assert costs.input_backward_s == (2.0, 0.0) and costs.weight_s == (1.0, 2.0)
    assert StageCosts.uniform(2, 1.0, 3.0).weight_s == (1.5, 1.5)  # unmeasured: half
    result = simulate(zb_h1(2, 1), costs)
    assert [(str(t.action), t.end - t.start) for t in result.timeline[0] if t.action.kind in ("I", "W")] == [
        ("0I0", 2.0), ("0W0", 1.0)]
    with pytest.raises(ValueError, match=r"stage 1: its W \(3.0 s\) is part of its backward \(2.0 s\)"):
        StageCosts((1.0, 1.0), (3.0, 2.0), (0.0,), (0.0,), weight_backward_s=(1.0, 3.0))
    with pytest.raises(ValueError, match="inconsistent"):
        StageCosts((1.0, 1.0), (3.0, 2.0), (0.0,), (0.0,), weight_backward_s=(1.0,))


def test_slowest_stage_sets_the_pace() -> None:
    # stage 1 twice as slow: steady state runs at its pace, m microbatches of 3 + fill/drain of the others
    costs = StageCosts((1.0, 2.0, 1.0), (0.0, 0.0, 0.0), (0.0, 0.0), (0.0, 0.0))
    result = simulate(gpipe(3, 4), costs)
    assert result.step_time_s == pytest.approx(1 + 4 * 2 + 1)


@pytest.mark.parametrize(("p", "m"), [(2, 8), (4, 8), (4, 16), (8, 32)])
def test_1f1b_holds_at_most_p_microbatches_gpipe_holds_m(p: int, m: int) -> None:
    costs = StageCosts((1.0,) * p, (2.0,) * p, (0.1,) * (p - 1), (0.1,) * (p - 1), (10.0,) * p)
    one = simulate(one_f_one_b(p, m), costs)
    gp = simulate(gpipe(p, m), costs)
    assert max(one.peak_in_flight) == p
    assert one.peak_in_flight == tuple(p - s for s in range(p))
    assert gp.peak_in_flight == (m,) * p
    assert one.peak_activation_bytes[0] == 10.0 * p
    assert gp.peak_activation_bytes[0] == 10.0 * m


def test_costs_must_match_the_schedule() -> None:
    with pytest.raises(ValueError, match="stages"):
        simulate(gpipe(3, 2), StageCosts.uniform(2, 1, 1))
    with pytest.raises(ValueError, match="inconsistent"):
        StageCosts((1.0, 1.0), (1.0,), (0.0,), (0.0,))
    with pytest.raises(ValueError, match=">= 0"):
        StageCosts.uniform(2, -1.0, 1.0)


def test_timeline_svg_has_one_box_per_action(tmp_path: Path) -> None:
    result = simulate(one_f_one_b(4, 8), StageCosts.uniform(4, 1e-3, 2e-3, 2e-4))
    path = draw_timeline(result, tmp_path / "timeline.svg")
    svg = path.read_text()
    root = ElementTree.fromstring(svg)  # well-formed XML
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    boxes = re.findall(r"<rect x=", svg)
    assert len(boxes) == sum(len(t) for t in result.timeline)
    assert "1f1b: step" in svg and "stage 3" in svg
    assert "1F7" in svg  # labelled compute boxes
    print(result.summary())
    zb = simulate(zb_h1(2, 2), StageCosts.uniform(2, 1.0, 2.0))
    split = draw_timeline(zb, tmp_path / "zb.svg").read_text()
    assert 'fill="#8cd17d"' in split and 'fill="#f28e2b"' in split  # I and W in their own colours


def test_stages_start_after_their_start_time() -> None:
    # stage 0 applies a 3 s update first; stage 1's own 1 s update hides behind it
    costs = StageCosts((1.0, 1.0), (2.0, 2.0), (0.0,), (0.0,), start_s=(3.0, 1.0))
    result = simulate(gpipe(2, 1), costs)
    assert result.step_time_s == pytest.approx(3 + 1 + 1 + 2 + 2)
    assert result.busy_s[0] == pytest.approx(3 + 1 + 2)
    with pytest.raises(ValueError, match="inconsistent"):
        StageCosts((1.0, 1.0), (2.0, 2.0), (0.0,), (0.0,), start_s=(3.0,))


def _one_host(ranks: int, cores: float, forward: float = 1.0, backward: float = 1.0) -> Sharing:
    return Sharing((cores,), (((0, 1.0, 1),),) * ranks, forward, backward)


def test_two_stages_on_one_core_take_turns_by_hand() -> None:
    # GPipe 2 x 2, F 1, B 2, free transfers, one core: stage 0's F0 alone [0,1]; its F1 and stage 1's F0
    # at half pace [1,3]; stage 1's F1 and B0 alone [3,6]; its B1 and stage 0's B0 at half pace [6,10];
    # stage 0's B1 alone [10,12]: the 12 s of work back to back (9 s on two cores)
    result = simulate(gpipe(2, 2), StageCosts.uniform(2, 1.0, 2.0), _one_host(2, 1.0))
    assert [(a, s, e) for a, s, e in _spans(result.timeline[0]) if "SEND" not in a and "RECV" not in a] == [
        ("0F0", 0, 1), ("0F1", 1, 3), ("0B0", 6, 10), ("0B1", 10, 12)]
    assert [(a, s, e) for a, s, e in _spans(result.timeline[1]) if "SEND" not in a and "RECV" not in a] == [
        ("1F0", 1, 3), ("1F1", 3, 4), ("1B0", 4, 6), ("1B1", 6, 10)]
    assert result.step_time_s == pytest.approx(12)
    assert simulate(gpipe(2, 2), StageCosts.uniform(2, 1.0, 2.0)).step_time_s == pytest.approx(9)


def test_a_busy_neighbour_slows_a_forward_and_a_backward_by_their_factors() -> None:
    # two cores, two workers: no core to wait for, but F at 1/2 and B at 1/1.5 while both are busy:
    # F0 [0,1] alone; F1 and 1F0 [1,3]; 1F1 [3,4] and 1B0 [4,6] alone; 1B1 and 0B0 [6,9]; 0B1 [9,11]
    result = simulate(gpipe(2, 2), StageCosts.uniform(2, 1.0, 2.0), _one_host(2, 2.0, 2.0, 1.5))
    assert result.step_time_s == pytest.approx(11)
    assert _spans(result.timeline[0])[-1] == ("0B1", 9, 11)


def test_four_stages_on_two_cores_against_the_cores_bound() -> None:
    # 4 equal stages x 8 microbatches: 96 s of work; two cores do at most 2 s of it per second, and the
    # fill and the drain leave one busy: the step lies between 48 s and the plain 33 s times 2
    costs = StageCosts.uniform(4, 1.0, 2.0)
    plain = simulate(gpipe(4, 8), costs).step_time_s
    shared = simulate(gpipe(4, 8), costs, _one_host(4, 2.0))
    assert plain == pytest.approx(33)
    assert 48 < shared.step_time_s < 2 * plain
    assert shared.step_time_s == pytest.approx(51)
    assert _one_host(4, 2.0).least_time([8.0] * 4, [16.0] * 4, [0.0] * 4) == pytest.approx(48)
    # as many cores as stages: each at its own pace, the plain play
    assert simulate(gpipe(4, 8), costs, _one_host(4, 4.0)).step_time_s == pytest.approx(plain)


def test_taking_turns_on_a_core_slows_the_compute_of_the_ranks_that_take_them() -> None:
    # the by-hand case above, two ranks on one core, every forward and backward at 1 / 1.5 of the shared
    # pace, alone or not: 0F0 alone 1.5 s, 0F1 and 1F0 together 3 s ([1.5, 4.5]), 1F1 alone 1.5 s, 1B0
    # alone 3 s ([6, 9]), 1B1 and 0B0 together 6 s ([9, 15]), 0B1 alone 3 s
    turns = Sharing((1.0,), (((0, 1.0, 1),),) * 2, turns_slowdown=1.5)
    assert (turns.turns(0), Sharing((2.0,), (((0, 1.0, 1),),) * 2, turns_slowdown=1.5).turns(0)) == (1.5, 1.0)
    assert Sharing((1.0,), (((0, 2.0, 1),),), turns_slowdown=1.5).turns(0) == 1.0  # one worker has no turns
    result = simulate(gpipe(2, 2), StageCosts.uniform(2, 1.0, 2.0), turns)
    assert [(a, s, e) for a, s, e in _spans(result.timeline[0]) if "SEND" not in a and "RECV" not in a] == [
        ("0F0", 0, 1.5), ("0F1", 1.5, 4.5), ("0B0", 9, 15), ("0B1", 15, 18)]
    assert result.step_time_s == pytest.approx(18)
    # two ranks on two cores never take turns
    two = Sharing((2.0,), (((0, 1.0, 1),),) * 2, turns_slowdown=1.5)
    assert simulate(gpipe(2, 2), StageCosts.uniform(2, 1.0, 2.0), two).step_time_s == pytest.approx(9)


def test_replicas_on_one_host_always_compete() -> None:
    # one stage, its two replicas on one host of two cores (one rank wanting 2 cores, 2 workers): every
    # forward and backward at its slowed pace, even with nothing else running
    sharing = Sharing((2.0,), (((0, 2.0, 2),),), 1.25, 1.5)
    result = simulate(gpipe(1, 2), StageCosts.uniform(1, 1.0, 2.0), sharing)
    assert result.step_time_s == pytest.approx(2 * (1.25 + 3.0))
    assert not Sharing((2.0, 2.0), (((0, 1.0, 1),), ((1, 1.0, 1),))).crowded  # apart: nothing shared


@settings(max_examples=40, deadline=None)
@given(p=st.integers(1, 5), m=st.integers(1, 8), cores=st.sampled_from([1.0, 2.0, 3.0]),
       f=st.floats(1.0, 2.0), b=st.floats(1.0, 2.0), name=st.sampled_from(["gpipe", "1f1b", "zb-h1"]),
       seed=st.integers(0, 2**16))
def test_sharing_only_slows_and_never_beats_the_cores(p: int, m: int, cores: float, f: float, b: float,
                                                      name: str, seed: int) -> None:
    rng = random.Random(seed)
    costs = StageCosts(tuple(rng.uniform(0.1, 2) for _ in range(p)),
                       tuple(rng.uniform(0.1, 4) for _ in range(p)),
                       tuple(rng.uniform(0, 0.3) for _ in range(p - 1)),
                       tuple(rng.uniform(0, 0.3) for _ in range(p - 1)),
                       start_s=tuple(rng.choice([0.0, rng.uniform(0, 0.5)]) for _ in range(p)))
    schedule = build_schedule(name, p, m)
    sharing = _one_host(p, cores, f, b)
    plain, shared = simulate(schedule, costs), simulate(schedule, costs, sharing)
    assert shared.step_time_s >= plain.step_time_s * (1 - 1e-9)
    work = [m * costs.forward_s[s] for s in range(p)], [m * costs.backward_s[s] for s in range(p)]
    assert shared.step_time_s >= sharing.least_time(*work, list(costs.start_s)) * (1 - 1e-9)
    # each rank's actions in its order, one after another
    for played in shared.timeline:
        assert all(x.end <= y.start + 1e-9 for x, y in itertools.pairwise(played))


def test_a_tail_runs_after_the_last_send_and_delays_only_its_own_stage() -> None:
    """GPipe 2 x 2, F 1, B 2, free transfers, a tail of 5 on each stage. Worked out by hand: stage 1 runs
    F0 1-2, F1 2-3, B0 3-5, B1 5-7 and its tail 7-12 after SEND_B1, which hands the gradients over at 7;
    stage 0 runs B0 5-7, B1 7-9 and its tail 9-14: the step 14 (without tails 9, and 12 if stage 1's tail
    delayed the gradients)."""
    sched = gpipe(2, 2)
    order = [[Step(a.stage, a.kind, a.microbatch) for a in sched.rank_actions(r)] for r in range(2)]
    plain = StageCosts((1.0, 1.0), (2.0, 2.0), (0.0,), (0.0,))
    tailed = StageCosts((1.0, 1.0), (2.0, 2.0), (0.0,), (0.0,), tail_s=(5.0, 5.0))
    assert play("gpipe", order, [(0,), (1,)], plain).step_time_s == pytest.approx(9.0)
    timing = play("gpipe", order, [(0,), (1,)], tailed)
    assert timing.step_time_s == pytest.approx(14.0)
    spans = {(a.stage, a.kind, a.microbatch): (t0, t1) for r in range(2)
             for a, t0, t1 in zip(timing.steps[r], timing.starts[r], timing.ends[r], strict=True)}
    assert spans[1, "SEND_B", 1] == pytest.approx((7.0, 12.0))  # the send's span ends with the tail
    assert spans[0, "RECV_B", 1] == pytest.approx((7.0, 7.0))  # the gradients came when the send ended
    assert spans[0, "B", 1] == pytest.approx((7.0, 14.0))  # the first stage: after its last backward
    assert timing.busy_s == pytest.approx((1 + 1 + 2 + 2 + 5, 1 + 1 + 2 + 2 + 5))
    # the played costs keep the backward alone: the one holding the tail is left out of the mean
    assert timing.played_costs(tailed).backward_s == pytest.approx((2.0, 2.0))
    # on shared cores (one host of 2 cores, no slowdown) the same
    shared = Sharing((2.0,), (((0, 1.0, 1),), ((0, 1.0, 1),)))
    assert play("gpipe", order, [(0,), (1,)], tailed, shared).step_time_s == pytest.approx(14.0)


@pytest.mark.parametrize("seed", range(30))
def test_hosts_alike_play_as_one(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The shared-core play merges hosts alike (``simulator._host_classes``): the same timing as playing
    every host, on random placements of replicas over hosts, symmetric (where the merge applies) or not."""
    import coordinator.planning.simulator as simulator

    rng = random.Random(seed)
    p = rng.randint(1, 5)
    m = rng.randint(1, 8)
    name = rng.choice(["gpipe", "1f1b", "zb-h1"])
    steps = [[Step(a.stage, a.kind, a.microbatch) for a in acts]
             for acts in (build_schedule(name, p, m).rank_actions(r) for r in range(p))]
    costs = StageCosts(tuple(rng.uniform(0.5, 2) for _ in range(p)),
                       tuple(rng.uniform(1, 4) for _ in range(p)),
                       tuple(rng.uniform(0, 0.3) for _ in range(p - 1)),
                       tuple(rng.uniform(0, 0.3) for _ in range(p - 1)),
                       start_s=tuple(rng.choice([0.0, rng.uniform(0, 1)]) for _ in range(p)))
    replicas = rng.randint(1, 6)
    per_host = rng.randint(1, 4)  # workers a host holds
    symmetric = seed % 3 != 0
    workers = [(r, d) for d in range(replicas) for r in range(p)]
    if not symmetric:
        rng.shuffle(workers)
    hosts = (len(workers) + per_host - 1) // per_host
    wants: list[dict[int, tuple[float, int]]] = [{} for _ in range(p)]
    for index, (r, _) in enumerate(workers):
        h = index // per_host
        k, n = wants[r].get(h, (0.0, 0))
        wants[r][h] = (k + rng.choice([1.0, 1.0, 2.0]) if not symmetric else k + 1.0, n + 1)
    sharing = Sharing(tuple(float(rng.choice([1, 2, 3])) if not symmetric else 2.0 for _ in range(hosts)),
                      tuple(tuple((h, k, n) for h, (k, n) in want.items()) for want in wants),
                      rng.choice([1.0, 1.2]), rng.choice([1.0, 1.5]))
    ranks = [(r,) for r in range(p)]
    merged = play(name, steps, ranks, costs, sharing)
    if symmetric and replicas > 1 and per_host == 1:  # the case the merge is for: it merged
        assert len(simulator._host_classes(sharing)[0]) < len(sharing.cores)
    monkeypatch.setattr(simulator, "MERGE_ALIKE_HOSTS", False)
    every = play(name, steps, ranks, costs, sharing)
    assert merged.step_time_s == pytest.approx(every.step_time_s, rel=1e-9, abs=1e-12)
    for a, b in zip(merged.ends, every.ends, strict=True):
        assert a == pytest.approx(b, rel=1e-9, abs=1e-12)
    assert merged.busy_s == pytest.approx(every.busy_s, rel=1e-9, abs=1e-12)
