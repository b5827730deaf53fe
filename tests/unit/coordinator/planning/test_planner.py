"""The planner: fastest plan that fits, fixed fields honoured, impossible requests refused with the reason."""

from __future__ import annotations

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from torch import nn

from coordinator.planning.config import PlanConfig
from coordinator.planning.cutting import CUTTERS, CutProblem, cut_even, cut_min_max
from coordinator.planning.graph import build_graph
from coordinator.planning.memory import Automatic
from coordinator.planning.plan import Plan
from coordinator.planning.planner import (
    ACTION_OVERHEAD_S,
    COLLECTIVE_EFFICIENCY,
    CONTROL_MESSAGE_S,
    GRADIENT_CHECK_BANDWIDTH_BPS,
    SHARED_HOST_BACKWARD_SLOWDOWN,
    SHARED_HOST_FORWARD_SLOWDOWN,
    SHARED_HOST_TURNS_SLOWDOWN,
    SYNC_CPU_BPS,
    TRANSFER_OVERHEAD_S,
    _backwards,
    _crossing,
    _Shared,
    candidate_plans,
    choose_plan,
    cut_problem,
    format_candidates,
    repriced,
)
from coordinator.planning.profile import Profile, profile_graph
from coordinator.planning.request import PlanningError
from coordinator.planning.resources import Resources, Worker
from coordinator.planning.simulator import Sharing
from services.compute.actions import validate_schedule
from services.compute.cell import Cell

MiB = 2**20


def big_model() -> Profile:
    """8 nodes of 8 MiB parameters each: with Adam, 32 MiB per node, 256 MiB for the whole model."""
    return Profile.synthetic([1e-3] * 8, param_bytes=[8 * MiB] * 8, activation_bytes=[MiB] * 8,
                             cut_bytes=[256 * 1024] * 7, microbatch_size=4)


def workers(num: int, memory: int) -> Resources:
    """``num`` CPU workers of one host (as ``Resources.local`` describes them)."""
    return Resources(workers=tuple(Worker(name=f"w{i}", memory_bytes=memory, host="h") for i in range(num)))


@pytest.mark.parametrize("memory", [140, 200])
def test_a_plan_only_an_option_the_search_may_not_choose_fits_is_named_and_the_same_without_plays(
        memory: int) -> None:
    """A model whose Adam state alone fills a GPU: nothing the automatic search picks fits, the optimizer
    offloaded does, and the refusal names that plan. The refusal's searches for fitting plans skip the
    plays of candidates whose cut cannot meet memory: their fitting candidates are the full evaluation's,
    and only those that cannot fit go unplayed (with why)."""
    prof = big_model()
    gpus = Resources(workers=tuple(Worker(name=f"g{i}", memory_bytes=memory * MiB, host="h", device="cuda",
                                          gpus=1) for i in range(2)))
    with pytest.raises(PlanningError, match="no plan fits in memory") as info:
        choose_plan(prof, gpus.model_copy(update={"workers": gpus.workers[:1]}), global_batch=8)
    assert "would fit: d=1 x p=1" in str(info.value) and "optimizer offloaded" in str(info.value)
    for res in (gpus, workers(4, memory * MiB)):
        every = Automatic(zero=(0, 1, 2, 3), recompute=True, offload=True)
        full = candidate_plans(prof, res, global_batch=8, automatic=every)
        quick = candidate_plans(prof, res, global_batch=8, automatic=every, fitting_only=True)
        assert [(c.data_parallel, c.num_stages, c.mode, c.schedule_name, c.num_microbatches, c.option)
                for c in quick] == [(c.data_parallel, c.num_stages, c.mode, c.schedule_name,
                                     c.num_microbatches, c.option) for c in full]
        assert [c for c in quick if c.fits] == [c for c in full if c.fits]
        assert any(c.fits for c in full) and any(not c.fits for c in full)
        for q, f in zip(quick, full, strict=True):  # the rest: unplayed only where the cut cannot fit
            assert q == f or (q.plan is None and f.plan is not None and q.reason and not f.fits)
        assert any(q.plan is None and f.plan is not None for q, f in zip(quick, full, strict=True))


def test_model_too_big_for_one_worker_gets_a_pipeline_that_fits() -> None:
    prof, res = big_model(), workers(4, 150 * MiB)
    with pytest.raises(PlanningError, match="no plan fits in memory") as info:
        choose_plan(prof, res, PlanConfig(num_stages=1, data_parallel=1), global_batch=32)
    assert "Without fixing data_parallel, num_stages, this plan fits" in str(info.value)
    plan = choose_plan(prof, res, global_batch=32)
    assert plan.num_stages >= 2
    assert all(st.peak_memory_bytes <= 150 * MiB for st in plan.stages)
    assert plan.peak_memory_bytes <= 150 * MiB
    assert [n for st in plan.stages for n in st.nodes] == [f"n{i}" for i in range(8)]
    validate_schedule(plan.schedule().actions, plan.num_microbatches)
    print("\n" + str(plan))


def test_nothing_fits_is_refused_with_what_would() -> None:
    with pytest.raises(PlanningError) as info:
        choose_plan(big_model(), workers(2, 60 * MiB), global_batch=32)
    msg = str(info.value)
    assert "no plan fits in memory" in msg
    assert "The least memory any of them needs is" in msg
    assert "the largest worker has 60 MiB" in msg
    assert "Give the workers at least" in msg


def test_auto_is_the_fastest_fitting_candidate() -> None:
    prof, res = big_model(), workers(4, 400 * MiB)
    cands = candidate_plans(prof, res, global_batch=32)
    plan = choose_plan(prof, res, global_batch=32)
    # the fastest replicated one: sharding and recompute only when nothing replicated fits
    fastest = min(c.step_time_s for c in cands if c.fits and not c.option.zero and not c.option.recompute)
    assert plan.step_time_s == pytest.approx(fastest)
    assert {(c.data_parallel, c.num_stages) for c in cands} >= {(1, 1), (2, 2), (4, 1), (1, 4)}
    assert "fits" in format_candidates(cands)


def test_parameter_server_mode_trades_time_for_memory() -> None:
    prof, res = big_model(), workers(4, 10_000 * MiB)
    coll = choose_plan(prof, res, PlanConfig(data_parallel=4, mode="collective"), global_batch=32)
    ps = choose_plan(prof, res, PlanConfig(data_parallel=4, mode="parameter_server"), global_batch=32)
    assert ps.peak_memory_bytes < coll.peak_memory_bytes
    assert ps.step_time_s >= coll.step_time_s
    # the pull is never hidden: at least (d-1)/d of the gradients at the link bandwidth
    grads = sum(n.grad_bytes for n in big_model().nodes)
    assert ps.sync_time_s >= 3 / 4 * grads / res.bandwidth_bps
    # with 200 MiB a full replica (256 MiB with Adam) only fits when the optimizer state is sharded
    squeezed = choose_plan(prof, workers(4, 200 * MiB), PlanConfig(data_parallel=4), global_batch=32)
    assert squeezed.mode == "parameter_server"


def test_fixed_fields_are_honoured(monkeypatch: pytest.MonkeyPatch) -> None:
    prof, res = big_model(), workers(4, 10_000 * MiB)
    fixed = PlanConfig(data_parallel=2, num_stages=2, schedule="gpipe", num_microbatches=4, mode="collective",
                       cutter="even")
    plan = choose_plan(prof, res, fixed, global_batch=32)
    shape = (plan.data_parallel, plan.num_stages, plan.schedule_name, plan.num_microbatches)
    assert shape == (2, 2, "gpipe", 4)
    assert plan.microbatch_size == 4 and plan.cutter == "even" and plan.bounds == (0, 4, 8)
    assert plan.dp_groups == (("w0", "w2"), ("w1", "w3"))
    assert plan.role("w3") == (1, 1)
    assert choose_plan(prof, res, PlanConfig(balance=[2, 6]), global_batch=32).bounds == (0, 2, 8)
    assert choose_plan(prof, res, PlanConfig(strategy="data_parallel"), global_batch=32).num_stages == 1
    assert choose_plan(prof, res, PlanConfig(strategy="pipeline"), global_batch=32).data_parallel == 1

    def last_heavy(problem: CutProblem) -> tuple[int, ...]:
        return (0, *range(1, problem.num_stages), problem.num_nodes)

    monkeypatch.setitem(CUTTERS, "last_heavy", last_heavy)  # a cutter is named by its registered name
    last = choose_plan(prof, res, PlanConfig(num_stages=3, cutter="last_heavy"), global_batch=32)
    assert last.bounds == (0, 1, 2, 8) and last.cutter == "last_heavy"


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(num_stages=9), r"num_stages=9 is impossible: the model has 8 nodes; use 1..8 stages"),
    (dict(data_parallel=3), r"global_batch=32 does not split evenly into data_parallel=3 replicas; "
                            r"degrees that divide it: \[1, 2, 4\]"),
    (dict(data_parallel=2, num_stages=3), r"needs 6 workers, the resources have 4; with data_parallel=2 "
                                          r"at most 2 stages fit"),
    (dict(data_parallel=2, num_microbatches=5), r"num_microbatches=5 does not divide global_batch=32"),
    (dict(data_parallel=8), r"data_parallel=8 needs 1..4 workers"),
    (dict(num_stages=6), r"num_stages=6 needs 6 workers, the resources have 4; use at most 4 stages"),
    (dict(balance=[4, 3]), r"balance \[4, 3\] must be positive node counts summing to the 8 nodes"),
    (dict(cutter="magic"), r"unknown cutter 'magic'"),
])
def test_impossible_requests_say_why(kwargs: dict[str, object], message: str) -> None:
    request = PlanConfig.model_validate(kwargs)
    with pytest.raises(PlanningError, match=message):
        choose_plan(big_model(), workers(4, 10_000 * MiB), request, global_batch=32)


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(strategy="pipeline", data_parallel=2), r"strategy='pipeline' means data_parallel=1, not 2: change "
                                                 r"plan.strategy or plan.data_parallel"),
    (dict(strategy="data_parallel", num_stages=2), r"strategy='data_parallel' means num_stages=1"),
    (dict(balance=[2, 6], num_stages=3), r"balance has 2 stages but num_stages=3"),
    (dict(balance=[2, 6], strategy="data_parallel"),
     r"strategy='data_parallel' means one stage, but balance has 2"),
    (dict(schedule="zigzag"), r"unknown schedule 'zigzag'; use one of \('gpipe', '1f1b', "),
    (dict(num_microbatches=0), r"num_microbatches\n  Input should be greater than or equal to 1"),
])
def test_contradicting_plan_fields_are_refused_by_the_config(kwargs: dict[str, object], message: str) -> None:
    """Rules between the plan's own fields are the config's: refused before planning, naming the fields."""
    with pytest.raises(ValidationError, match=message):
        PlanConfig.model_validate(kwargs)


def test_plan_round_trips_and_prints() -> None:
    plan = choose_plan(big_model(), workers(4, 150 * MiB), global_batch=32)
    assert Plan.from_json(plan.to_json()) == plan
    wire = msgpack.unpackb(msgpack.packb(plan.model_dump(mode="json")))
    assert Plan.model_validate(wire) == plan
    text = str(plan)
    assert "predicted step" in text and "crossing tensors per microbatch" in text
    assert all(w in text for row in plan.placement for w in row)
    assert text.count("\n") >= 6 + plan.num_stages
    bad = plan.model_dump()
    bad["global_batch"] = 31
    with pytest.raises(ValueError, match="global_batch must equal"):
        Plan.model_validate(bad)


def test_real_model_from_graph_to_plan() -> None:
    torch.manual_seed(0)
    model = [Cell("embed", nn.Linear(32, 256)), Cell("block1", nn.Sequential(nn.Linear(256, 256), nn.GELU())),
             Cell("block2", nn.Sequential(nn.Linear(256, 256), nn.GELU())), Cell("head", nn.Linear(256, 8))]
    sample = torch.randn(8, 32)
    prof = profile_graph(build_graph(model, sample), sample, repeats=5, num_threads=1)
    plan = choose_plan(prof, Resources.local(workers=2, memory_bytes=2**30),
                       PlanConfig(num_stages=2, num_microbatches=4), global_batch=32)
    assert plan.microbatch_size == 8 and plan.stages[0].outgoing.tensors[0].shape[0] == 8
    assert plan.stages[1].incoming == plan.stages[0].outgoing
    assert plan.stages[0].incoming == prof.cuts[0]
    assert plan.stages[0].outgoing.structure == "tensor"
    print("\n" + str(plan))


def test_min_max_beats_even_split_on_a_real_uneven_model() -> None:
    # eight cheap blocks then four 32x heavier ones (a wide MLP tail), profiled on this machine
    torch.manual_seed(0)
    cheap = [Cell(f"cheap{i}", nn.Sequential(nn.Linear(128, 128), nn.ReLU())) for i in range(8)]
    heavy = [Cell(f"heavy{i}", nn.Sequential(nn.Linear(128, 2048), nn.ReLU(), nn.Linear(2048, 128)))
             for i in range(4)]
    sample = torch.randn(64, 128)
    # 20 runs a node: its lower quartile needs 5 runs no other process preempted (a loaded machine)
    prof = profile_graph(build_graph(cheap + heavy, sample), sample, repeats=20, num_threads=1)
    res = Resources.local(workers=4)
    problem = cut_problem(prof, 4, bandwidth_bps=res.bandwidth_bps, latency_s=res.latency_s)
    even = problem.max_stage_time(cut_even(problem))
    best = problem.max_stage_time(cut_min_max(problem))
    print(f"\nreal uneven model, 4 stages: even split slowest stage {even * 1e3:.3f} ms, "
          f"min-max {best * 1e3:.3f} ms, ratio {even / best:.2f}x (bounds {cut_min_max(problem)})")
    assert even / best > 1.3  # 1.7-1.9x measured; margin for a loaded machine


def test_strategies_use_more_than_one_worker() -> None:
    # a tiny model: one worker would be fastest, but the strategy asks for replicas or stages
    prof = Profile.synthetic([1e-5] * 4, param_bytes=[1024] * 4, cut_bytes=[64] * 3, microbatch_size=4)
    res = workers(2, 10_000 * MiB)
    assert choose_plan(prof, res, PlanConfig(strategy="data_parallel"), global_batch=8).data_parallel == 2
    assert choose_plan(prof, res, PlanConfig(strategy="pipeline"), global_batch=8).num_stages == 2
    one = Resources(workers=(Worker(name="w0", memory_bytes=10_000 * MiB),))
    assert choose_plan(prof, one, PlanConfig(strategy="data_parallel"), global_batch=8).data_parallel == 1


def test_step_pays_the_optimizer_and_the_messages() -> None:
    prof = Profile.synthetic([1e-3] * 2, param_bytes=[64 * MiB] * 2, microbatch_size=4, optimizer="sgd")
    plan = choose_plan(prof, workers(1, 10_000 * MiB), global_batch=4)
    assert plan.stages[0].optimizer_s > 0
    # the request and the replies, and the read of the stage's 128 MiB of gradients before it replies
    assert plan.overhead_s == pytest.approx(2 * CONTROL_MESSAGE_S + 128 * MiB / GRADIENT_CHECK_BANDWIDTH_BPS)
    compute = plan.stages[0].forward_s + plan.stages[0].backward_s
    assert plan.step_time_s == pytest.approx(plan.stages[0].optimizer_s + compute + plan.overhead_s)


def test_only_backward_after_the_first_bucket_hides_the_all_reduce() -> None:
    # 4 nodes of 16 MiB of gradients: the first bucket (FIRST_BUCKET_BYTES, 1 MiB) is full with the last
    # node's gradient, so the three nodes' backwards before it hide the all-reduce, the last one's does not
    prof = Profile.synthetic([1e-3] * 4, backward_s=[1e-3] * 4, param_bytes=[16 * MiB] * 4, microbatch_size=4)
    plan = choose_plan(prof, workers(2, 10_000 * MiB), PlanConfig(data_parallel=2, mode="collective"),
                       global_batch=8)
    res = workers(2, 10_000 * MiB)
    allreduce = 64 * MiB / (COLLECTIVE_EFFICIENCY * res.bandwidth_bps) + 2 * res.latency_s
    # two replicas on one host compete all the time: their backwards run at the shared-host pace
    assert allreduce > 4e-3  # longer than the whole backward: what hides it shows
    assert plan.sync_time_s == pytest.approx(allreduce - 3e-3 * SHARED_HOST_BACKWARD_SLOWDOWN)


def test_a_host_without_a_core_to_spare_cannot_hide_the_sync_behind_the_backward() -> None:
    """[Note: the sync's own CPU]: the all-reduce's own CPU work hides behind the backward only on the host's
    spare cores; without one it is left unhidden, with one core for two sync threads half of it."""
    # a long backward after the first bucket: the wire time of the all-reduce hides completely
    prof = Profile.synthetic([1e-3] * 4, backward_s=[0.5] * 4, param_bytes=[16 * MiB] * 4, microbatch_size=4)
    cpu_work = 64 * MiB / SYNC_CPU_BPS  # an all-reduce over 2 moves the gradients' bytes per rank

    def sync(host_cpus: int | None, device: str = "cpu", mode: str = "collective") -> float:
        res = Resources(workers=tuple(
            Worker(name=f"w{i}", memory_bytes=10_000 * MiB, host="h", host_cpus=host_cpus, device=device,
                   gpus=1 if device == "cuda" else 0) for i in range(2)))
        plan = choose_plan(prof, res, PlanConfig(data_parallel=2, mode=mode), global_batch=8)
        return plan.sync_time_s

    assert sync(None) == 0.0  # the host's cores not given: none waits for a core (as before)
    assert sync(4) == 0.0  # two spare cores for the two sync threads
    assert sync(2) == pytest.approx(cpu_work)  # the workers' threads want both cores
    assert sync(3) == pytest.approx(cpu_work / 2)  # one spare core for two sync threads
    assert sync(2, "cuda") == 0.0  # NCCL: no CPU work
    # a parameter server's push and pull move 2 G a worker: CPU work too, never cheaper than the all-reduce
    wire = sync(None, mode="parameter_server")
    assert sync(2, mode="parameter_server") == pytest.approx(max(2 * cpu_work, wire))
    assert sync(2, mode="parameter_server") > sync(2)


def test_a_stage_pays_its_cold_forward_once_a_step() -> None:
    """[Note: a warm forward] in profile.py: a stage's first microbatch finds its weights cold, the rest warm;
    the planner prices a microbatch's forward at the warm time and the difference once per step."""
    cold = Profile.synthetic([3e-3] * 4, backward_s=[2e-3] * 4, param_bytes=[MiB] * 4, microbatch_size=4)
    warm = cold.model_copy(update={"nodes": tuple(nd.model_copy(update={"warm_forward_s": 1e-3})
                                                  for nd in cold.nodes)})
    res = Resources(workers=tuple(Worker(name=f"w{i}", memory_bytes=1000 * MiB) for i in range(2)))  # apart
    for m in (1, 2, 8):
        fixed = PlanConfig(num_stages=2, data_parallel=1, num_microbatches=m, schedule="gpipe")
        before = choose_plan(cold, res, fixed, global_batch=4 * m)
        plan = choose_plan(warm, res, fixed, global_batch=4 * m)
        for a, b in zip(before.stages, plan.stages, strict=True):
            assert a.forward_s == pytest.approx(2 * 3e-3 + ACTION_OVERHEAD_S)
            assert b.forward_s == pytest.approx(2 * 1e-3 + 2 * 2e-3 / m + ACTION_OVERHEAD_S)
        if m == 1:  # one microbatch: its forward is the cold one, as before
            assert plan.step_time_s == pytest.approx(before.step_time_s)
        else:
            assert plan.step_time_s < before.step_time_s


def test_only_workers_sharing_a_host_slow_each_other_down() -> None:
    prof = Profile.synthetic([1e-3] * 4, backward_s=[2e-3] * 4, param_bytes=[MiB] * 4, microbatch_size=4)

    def step(hosts: tuple[str | None, str | None]) -> Plan:
        res = Resources(workers=tuple(Worker(name=f"w{i}", memory_bytes=1000 * MiB, host=h)
                                      for i, h in enumerate(hosts)))
        fixed = PlanConfig(num_stages=2, data_parallel=1, num_microbatches=2, schedule="gpipe")
        return choose_plan(prof, res, fixed, global_batch=8)

    apart, unknown, together = step(("a", "b")), step((None, None)), step(("a", "a"))
    assert apart.pipeline_time_s == unknown.pipeline_time_s
    # slower, but not by the whole factor: the fill and the drain compute alone
    slowest = apart.pipeline_time_s * SHARED_HOST_BACKWARD_SLOWDOWN
    assert apart.pipeline_time_s < together.pipeline_time_s < slowest
    for a, t in zip(apart.stages, together.stages, strict=True):
        assert a.forward_s < t.forward_s < a.forward_s * SHARED_HOST_FORWARD_SLOWDOWN + 1e-12
        assert a.backward_s < t.backward_s < a.backward_s * SHARED_HOST_BACKWARD_SLOWDOWN + 1e-12


def test_the_sharing_follows_the_hosts_and_their_cores() -> None:
    prof = Profile.synthetic([1e-3] * 4, backward_s=[2e-3] * 4, param_bytes=[MiB] * 4, microbatch_size=4)

    def sharing(workers: tuple[Worker, ...], d: int = 1, p: int = 2) -> Sharing | None:
        res = Resources(workers=workers)
        shared = _Shared(prof, res)
        names = [w.name for w in workers]
        placement = tuple(tuple(names[r * p:(r + 1) * p]) for r in range(d))
        return shared.placed(placement, p).sharing(p)

    def cpu(name: str, host: str | None, cpus: int = 1, host_cpus: int | None = None) -> Worker:
        return Worker(name=name, memory_bytes=MiB, host=host, cpus=cpus, host_cpus=host_cpus)

    assert sharing((cpu("a", "h"), cpu("b", "g"))) is None  # apart: each at its own pace
    assert sharing((cpu("a", None), cpu("b", None))) is None
    gpu = Worker(name="d", device="cuda", gpus=1, memory_bytes=MiB, host="h")
    assert sharing((cpu("a", "h"), gpu)) is None  # a GPU stage is no CPU rival
    # two workers of one host: as many cores as their cpus, unless the host says how many it has
    together = sharing((cpu("a", "h"), cpu("b", "h")))
    assert together is not None and together.cores == (2.0,) and together.wants == (((0, 1.0, 1),),) * 2
    assert together.forward_slowdown == SHARED_HOST_FORWARD_SLOWDOWN
    four = sharing(tuple(cpu(f"w{i}", "h", host_cpus=2) for i in range(4)), p=4)
    assert four is not None and four.cores == (2.0,) and four.most_stretch() == pytest.approx(
        2 * SHARED_HOST_BACKWARD_SLOWDOWN * SHARED_HOST_TURNS_SLOWDOWN)  # 4 take turns on 2 cores
    # replicas: a rank wants its replicas' threads on each of their hosts
    dp = sharing((cpu("a", "h", 2), cpu("b", "g"), cpu("c", "h", 2), cpu("e", "g")), d=2)
    assert dp is not None and dp.cores == (4.0, 2.0) and dp.wants == (((0, 4.0, 2),), ((1, 2.0, 2),))


def test_four_stages_on_two_cores_take_turns() -> None:
    prof = Profile.synthetic([1e-3] * 4, backward_s=[2e-3] * 4, microbatch_size=4)

    def step(host_cpus: int | None) -> Plan:
        res = Resources(workers=tuple(Worker(name=f"w{i}", memory_bytes=1000 * MiB, host="h",
                                             host_cpus=host_cpus) for i in range(4)))
        fixed = PlanConfig(num_stages=4, data_parallel=1, num_microbatches=8, schedule="gpipe")
        return choose_plan(prof, res, fixed, global_batch=32)

    roomy, crowded = step(None), step(2)
    work = sum(st.forward_s + st.backward_s for st in roomy.stages) * 8  # every stage's, at the roomy pace
    assert crowded.pipeline_time_s > roomy.pipeline_time_s * 1.3
    assert crowded.pipeline_time_s >= work / 2  # two cores do it at best all the time
    for a, t in zip(roomy.stages, crowded.stages, strict=True):  # each action as played, on average
        assert t.forward_s > a.forward_s and t.backward_s > a.backward_s


def test_balancing_a_pipeline_gains_less_on_a_shared_host() -> None:
    # 12 layers in 8 nodes, the heavy ones last (bench.models:uneven): [4, 4] puts 4 and 8 layers on the
    # stages, [6, 2] 6 and 6. On one host the light stage of the even split competes with the heavy one
    # all the time, the heavy one only while the light one computes: balancing gains less there.
    layers = [1, 1, 1, 1, 1, 1, 3, 3]
    prof = Profile.synthetic([1e-3 * n for n in layers], cut_bytes=[4096] * 7, microbatch_size=8)

    def gain(hosts: tuple[str, str]) -> float:
        res = Resources(workers=tuple(Worker(name=f"w{i}", memory_bytes=1000 * MiB, host=h)
                                      for i, h in enumerate(hosts)))

        def step(balance: list[int]) -> float:
            fixed = PlanConfig(num_stages=2, data_parallel=1, num_microbatches=8, schedule="1f1b",
                               balance=balance)
            return choose_plan(prof, res, fixed, global_batch=64).step_time_s

        return step([4, 4]) / step([6, 2])

    apart, together = gain(("a", "b")), gain(("a", "a"))
    print(f"\n[6, 2] gains {apart:.3f}x over [4, 4] on two hosts, {together:.3f}x on one")
    assert apart > 1.2 and 1.0 < together < apart - 0.05


def test_every_transfer_pays_its_endpoints_overhead() -> None:
    prof = Profile.synthetic([1e-3] * 2, cut_bytes=[MiB], microbatch_size=4)
    res = workers(2, 1000 * MiB)
    plan = choose_plan(prof, res, PlanConfig(num_stages=2, data_parallel=1, num_microbatches=1),
                       global_batch=4)
    one_way = TRANSFER_OVERHEAD_S + res.latency_s + MiB / res.bandwidth_bps
    # the activations out and their gradients back, on both stages
    assert [st.transfer_s for st in plan.stages] == pytest.approx([2 * one_way, 2 * one_way])


def test_interleaved_plans_put_chunks_stages_on_each_worker_and_shrink_the_bubble() -> None:
    prof, res = big_model(), workers(2, 1 << 40)
    one = choose_plan(prof, res, PlanConfig(num_stages=2, schedule="1f1b", num_microbatches=4),
                      global_batch=32)
    plan = choose_plan(prof, res, PlanConfig(schedule="interleaved-1f1b", chunks=2, num_microbatches=4),
                       global_batch=32)
    assert (plan.num_stages, plan.chunks, plan.num_ranks, plan.num_workers) == (4, 2, 2, 2)
    assert plan.placement == (("w0", "w1", "w0", "w1"),) and plan.stages_of("w1") == (1, 3)
    assert plan.schedule().ranks == ((0, 2), (1, 3))
    assert plan.bubble_fraction < one.bubble_fraction  # (R-1)/(vm+R-1) = 1/9 against 1/5, less overheads
    assert Plan.from_json(plan.to_json()) == plan
    text = str(plan)
    assert "2 worker(s) (2 stages per worker: 0,2 | 1,3), interleaved-1f1b" in text, text
    assert "(2 per worker) interleaved-1f1b" in plan.summary()
    # memory per worker: its two stages', each at its own peak
    assert plan.peak_memory_bytes == max(plan.stages[0].peak_memory_bytes + plan.stages[2].peak_memory_bytes,
                                         plan.stages[1].peak_memory_bytes + plan.stages[3].peak_memory_bytes)
    with pytest.raises(ValueError, match="with chunks=2, the worker of stage s"):
        Plan.model_validate({**plan.model_dump(), "placement": (("w0", "w1", "w1", "w0"),)})


def test_the_search_tries_interleaved_shapes_and_refuses_what_the_schedule_cannot_run() -> None:
    prof, res = big_model(), workers(2, 1 << 40)
    cands = candidate_plans(prof, res, PlanConfig(strategy="pipeline"), global_batch=32)
    chunked = {(c.num_stages, c.chunks) for c in cands if c.schedule_name == "interleaved-1f1b"}
    assert chunked == {(4, 2), (6, 3), (8, 4)}  # 2 workers, chunks 2..4, as far as the 8 nodes cut
    assert all(c.num_microbatches % 2 == 0 or c.num_microbatches < 2
               for c in cands if c.schedule_name == "interleaved-1f1b")
    assert "interleaved-1f1b/2" in format_candidates(cands, limit=100)
    with pytest.raises(PlanningError, match=r"num_microbatches=5 .* use a multiple of 2"):
        choose_plan(prof, res, PlanConfig(strategy="pipeline", schedule="interleaved-1f1b", chunks=2,
                                          num_microbatches=5), global_batch=40)
    with pytest.raises(PlanningError, match="chunks=2 puts several stages on each worker, which schedule"):
        choose_plan(prof, res, PlanConfig(schedule="1f1b", chunks=2), global_batch=32)
    with pytest.raises(PlanningError, match=r"num_stages=6 needs 6 workers, .* or interleaved-1f1b"):
        choose_plan(prof, res, PlanConfig(num_stages=6), global_batch=32)
    fixed = choose_plan(prof, res, PlanConfig(num_stages=6, schedule="interleaved-1f1b"), global_batch=32)
    assert (fixed.chunks, fixed.num_workers) == (3, 2)


def _split(prof: Profile, inp: float, weight: float, fixed: float = 0.0) -> Profile:
    """``prof`` with every node's backward timed as halves: ``I`` = ``inp`` x its backward, ``W`` = ``weight``
    x it, each with ``fixed`` of itself not growing with the microbatch."""
    nodes = tuple(nd.model_copy(update={"input_backward_s": inp * nd.backward_s,
                                        "weight_s": weight * nd.backward_s,
                                        "input_backward_fixed_s": fixed * inp * nd.backward_s,
                                        "weight_fixed_s": fixed * weight * nd.backward_s})
                  for nd in prof.nodes)
    return prof.model_copy(update={"nodes": nodes})


def test_each_schedule_prices_its_backwards_as_its_workers_run_them() -> None:
    """Per-microbatch forward 1 ms and backward 2 ms a node, its halves I 0.9 ms and W 0.8 ms (half of each
    fixed): 2 nodes a stage at the profiled microbatch of 4. Worked out here, as the executor runs them
    (``services/compute/executor.py``): a product of ``k`` microbatches' W's in place costs W's fixed part
    once and its per-row part ``k`` times, and so does the step's first, which finds no ``.grad`` (written
    into the tensor the last step handed over); through autograd into a ``.grad`` (zb-h1's last, which
    fires the hooks) that and one microbatch's ``B - I - W`` (0.3 ms a node: the new gradient tensor and
    its addition); GPipe's and a lone replica's last
    one runs after the last backward's send (the tail); mixed precision runs plain backwards."""
    base = Profile.synthetic([1e-3] * 4, backward_s=[2e-3] * 4, param_bytes=[MiB] * 4, microbatch_size=4)
    prof = _split(base, 0.45, 0.4, fixed=0.5)
    res = Resources(workers=tuple(Worker(name=f"w{i}", memory_bytes=1000 * MiB, host=f"h{i}")
                                  for i in range(2)))

    def stage0(schedule: str, alone: bool, precision: str = "fp32", profile: Profile = prof
               ) -> tuple[float, float, float]:
        defer = [schedule == "gpipe"] * 2
        back, w, tail = _backwards(_Shared(profile), 4, [(0, 2), (2, 4)], (schedule, 2, 8, 1), defer,
                                   precision, False, [1.0, 1.0], alone)
        return back[0], w[0], tail[0]

    i, plain = 2 * 0.9e-3, 2 * 2e-3  # a stage's I and plain B at the profiled microbatch (4 samples)

    def in_place(k: int) -> float:  # W of k microbatches in one product: the fixed part once
        return 2 * (0.4e-3 + 0.4e-3 * k)

    def autograd(k: int) -> float:  # the product and the new tensor's extra pass into .grad
        return in_place(k) + 2 * (2e-3 - 0.9e-3 - 0.8e-3)

    # GPipe: every B an I, the one product over the 8 microbatches after the last send
    assert stage0("gpipe", True) == pytest.approx((i, 0.0, in_place(8)))
    assert stage0("gpipe", False) == pytest.approx((i, 0.0, in_place(8)))
    # 1F1B with replicas: the first and last B plain, the 6 between I's, their W's held (no rows: within
    # the share) and added in place before the last B
    assert stage0("1f1b", False) == pytest.approx(((6 * i + 2 * plain + in_place(6)) / 8, 0.0, 0.0))
    # alone: every B holds its W; the first product (no .grad yet) after the last send
    assert stage0("1f1b", True) == pytest.approx((i, 0.0, in_place(8)))
    # zb-h1 with replicas: each W apart (FFIWFIW...IW), the first from no .grad, the last after the last I
    # through autograd into the .grad the others made; alone: every W held until the one after the last I,
    # which finds no .grad
    assert stage0("zb-h1", False) == pytest.approx((i + (autograd(1) + 7 * in_place(1)) / 8,
                                                    (autograd(1) + 7 * in_place(1)) / 8, 0.0))
    assert stage0("zb-h1", True) == pytest.approx((i + in_place(8) / 8, in_place(8) / 8, 0.0))
    assert stage0("1f1b", True, "bf16") == pytest.approx((plain, 0.0, 0.0))
    # rows held: 48 KiB a node a microbatch, the limit an eighth of the stage's 2 MiB of weights (256 KiB):
    # a product every 3 microbatches (288 KiB > 256 KiB), the last 2 after the send
    rows = prof.model_copy(update={"nodes": tuple(nd.model_copy(update={"deferred_bytes": 48 * 1024})
                                                  for nd in prof.nodes)})
    assert stage0("1f1b", True, profile=rows) == pytest.approx(
        (i + (in_place(3) + in_place(3)) / 8, 0.0, in_place(2)))
    # with replicas: B0 plain, B1-B3 held and added, B4-B6 held and added before the last B (plain)
    assert stage0("1f1b", False, profile=rows) == pytest.approx(
        ((6 * i + 2 * plain + 2 * in_place(3)) / 8, 0.0, 0.0))
    # the plan: GPipe's stage 0 B is its I, its tail played after its last backward
    fixed = PlanConfig(num_stages=2, data_parallel=1, num_microbatches=8, schedule="gpipe", balance=[2, 2])
    plan = choose_plan(prof, res, fixed, global_batch=32)
    assert plan.stages[0].backward_s == pytest.approx(i + ACTION_OVERHEAD_S)
    assert plan.stages[0].tail_s == pytest.approx(in_place(8))  # kept for the predicted timeline
    assert plan.stages[0].weight_s == 0.0
    zb = choose_plan(prof, res, fixed.model_copy(update={"schedule": "zb-h1"}), global_batch=32)
    assert zb.stages[0].weight_s == pytest.approx(in_place(8) / 8 + ACTION_OVERHEAD_S)
    # unsplit profiles price every backward plain
    plain = choose_plan(base, res, PlanConfig(num_stages=2, data_parallel=1, num_microbatches=8,
                                              schedule="gpipe", balance=[2, 2]), global_batch=32)
    assert plain.stages[0].backward_s == pytest.approx(4e-3 + ACTION_OVERHEAD_S)


@given(rows=st.one_of(st.floats(0, 1e12, allow_nan=False), st.integers(0, 4096).map(float),
                     st.integers(1, 64).map(lambda k: 0.1 * k)),
       limit=st.one_of(st.integers(0, 10**12), st.integers(0, 300)), most=st.integers(0, 200))
@settings(max_examples=500)
def test_the_held_count_that_crosses_the_limit_is_the_first_one_whose_rows_exceed_it(rows: float, limit: int,
                                                                                       most: int) -> None:
    """The fewest held microbatches whose rows exceed the limit, as the executor compares them
    (``k * rows > limit``), counted one by one; 0 when no count up to the backwards does."""
    assert _crossing(rows, limit, most) == next((k for k in range(1, most + 1) if k * rows > limit), 0)
    # a count too large to walk to: the same comparison, found by halving
    k = _crossing(1e-9, 1, 10**18)
    assert k * 1e-9 > 1 and not (k - 1) * 1e-9 > 1
    assert _crossing(5e-324, 1, 10**18) == 0


@pytest.mark.parametrize("workers", [1, 2])
def test_one_stage_is_not_given_a_split_backward_unless_asked(workers: int) -> None:
    """[Note: no split backward on one stage]: zb-h1 fills a pipeline's bubbles; one stage has none, and ran
    slower under it (measured), though the cost model priced it faster."""
    profile = Profile.synthetic([2e-3] * 4, param_bytes=[1 << 20] * 4, activation_bytes=[1 << 20] * 4,
                                cut_bytes=[1 << 16] * 3, microbatch_size=4)
    resources = Resources.local(workers)
    one = PlanConfig(data_parallel=workers, num_stages=1, num_microbatches=1)
    assert choose_plan(profile, resources, one, global_batch=8 * workers).schedule_name != "zb-h1"
    asked = PlanConfig(data_parallel=workers, num_stages=1, num_microbatches=1, schedule="zb-h1")
    assert choose_plan(profile, resources, asked, global_batch=8 * workers).schedule_name == "zb-h1"
    if workers == 2:  # a pipeline may still get it
        piped = PlanConfig(data_parallel=1, num_stages=2, num_microbatches=8, schedule="zb-h1")
        assert choose_plan(profile, resources, piped, global_batch=16).schedule_name == "zb-h1"
        shapes = {(c.num_stages, c.schedule_name) for c in candidate_plans(
            profile, resources, PlanConfig(data_parallel=1, num_microbatches=8), global_batch=16)}
        assert (2, "zb-h1") in shapes and (1, "zb-h1") not in shapes


def test_a_plan_priced_again_keeps_its_shape_and_takes_the_new_profiles_costs() -> None:
    times = [1e-3, 4e-3, 2e-3, 3e-3, 5e-3, 1e-3, 2e-3, 6e-3]

    def profile(scale: float, activation: int = MiB) -> Profile:
        return Profile.synthetic([t * scale for t in times], param_bytes=[MiB] * 8, microbatch_size=4,
                                 activation_bytes=[activation] * 8, cut_bytes=[64 * 1024] * 7)

    res = workers(4, 1 << 30)
    request = PlanConfig(num_stages=4, data_parallel=1)
    plan = choose_plan(profile(1.0), res, request, global_batch=64)
    assert repriced(plan, profile(1.0), res, request) == plan  # the same profile: the very plan
    slower = repriced(plan, profile(2.0), res, request)
    shape = ("bounds", "placement", "schedule_name", "num_microbatches", "microbatch_size", "chunks", "mode")
    assert all(getattr(slower, f) == getattr(plan, f) for f in shape)
    # a stage's forward is its nodes' times (the profile's) and a fixed cost per action: affine in the times
    # (but for the pace of the host's shared cores, which moves with what runs beside it: 1e-4 here)
    free = repriced(plan, profile(0.0), res, request)
    grown = [s.forward_s - p.forward_s for s, p in zip(slower.stages, plan.stages, strict=True)]
    first = [p.forward_s - f.forward_s for p, f in zip(plan.stages, free.stages, strict=True)]
    assert grown == pytest.approx(first, rel=1e-3)
    assert all(p.forward_s > 1.5 * f.forward_s for p, f in zip(plan.stages, free.stages, strict=True))
    assert slower.step_time_s > 1.5 * plan.step_time_s
    # a search on the slower profile may cut otherwise: the plan priced again does not
    with pytest.raises(PlanningError, match="fit"):
        repriced(plan, profile(1.0, activation=512 * MiB), res, request)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_pipeline_over_a_fast_and_a_slow_worker_gives_the_fast_one_more_nodes(device: str) -> None:
    """[Note: a stage's pace] in cutting.py: 16 equal nodes over a worker twice as fast as the other. Cut as
    if both ran at the slower's speed (8 and 8) the pipeline took 800 ms and the search kept to the fast
    worker alone (774 ms); cut by speed (11 and 5) it takes 562 ms, and the search takes it, as the
    exhaustive one does."""
    prof = Profile.synthetic([1e-3] * 16, param_bytes=[10**6] * 16, activation_bytes=[10**5] * 16,
                             cut_bytes=[64 * 1024] * 15)
    res = Resources(workers=tuple(Worker(name=name, host=name, speed=speed, device=device,
                                         memory_bytes=8 << 30, gpus=int(device == "cuda"))
                                  for name, speed in (("fast", 2.0), ("slow", 1.0))))
    pipeline = choose_plan(prof, res, PlanConfig(data_parallel=1, num_stages=2), global_batch=32)
    assert pipeline.bounds == (0, 11, 16) and pipeline.placement == (("fast", "slow"),)
    fast = [s.forward_s + s.backward_s for s in pipeline.stages]
    assert max(fast) / min(fast) < 1.2  # the stages' compute evened by speed (11 / 2 against 5 / 1)
    alone = choose_plan(prof, res, PlanConfig(data_parallel=1, num_stages=1), global_batch=32)
    assert pipeline.step_time_s < 0.8 * alone.step_time_s
    chosen = choose_plan(prof, res, PlanConfig(), global_batch=32)
    assert chosen == choose_plan(prof, res, PlanConfig(), global_batch=32, exhaustive=True)
    assert chosen.num_workers == 2 and chosen.step_time_s <= pipeline.step_time_s
