"""The planner's memory model: per-worker bytes of each option, computed by hand, and the choice it drives.

Each option (ZeRO 0-3, hybrid groups, recompute, offload) is fixed in the plan section on a synthetic
model whose parts are round MiB counts, and the plan's per-stage breakdown must equal the sums
worked out here from the table in ``coordinator/planning/memory.py``; then the search: a model too big
for replication gets a sharded plan, a small one keeps the replicated plan, the pruned search
chooses as the exhaustive one does, and the floor counts ZeRO.
"""

from __future__ import annotations

import itertools
import random

import pytest

from coordinator.planning.config import PlanConfig
from coordinator.planning.cutting import CutProblem, cut_min_max
from coordinator.planning.memory import REPLICATED, Automatic, MemoryOption, node_memory, replicated_static
from coordinator.planning.plan import MemoryUse, Plan
from coordinator.planning.planner import (
    COLLECTIVE_EFFICIENCY,
    CellBytes,
    candidate_plans,
    check_memory_floor,
    choose_plan,
    format_candidates,
    memory_floor,
)
from coordinator.planning.profile import Profile
from coordinator.planning.request import PlanningError
from coordinator.planning.resources import Resources, Worker
from coordinator.planning.sharding import OFFLOAD_BANDWIDTH_BPS, ring_pass, sharded_sync

MiB = 2**20
KiB = 2**10
EVERY = Automatic(zero=(0, 1, 2, 3), recompute=True, offload=True)


def model() -> Profile:
    """Parameters 1, 2, 3, 4 MiB (Adam: state twice that), activations 1, 1, 1, 2 MiB, node inputs
    0, 256, 512, 128 KiB, all at a microbatch of 4."""
    return Profile.synthetic([1e-3] * 4, param_bytes=[MiB, 2 * MiB, 3 * MiB, 4 * MiB],
                             activation_bytes=[MiB, MiB, MiB, 2 * MiB],
                             cut_bytes=[256 * KiB, 512 * KiB, 128 * KiB], microbatch_size=4)


def cpu(num: int, memory: int = 1 << 40) -> Resources:
    return Resources(workers=tuple(Worker(name=f"w{i}", memory_bytes=memory, host="h") for i in range(num)))


def cuda(num: int, memory: int = 1 << 40) -> Resources:
    return Resources(workers=tuple(Worker(name=f"g{i}", device="cuda", gpus=1, memory_bytes=memory, host="h")
                                   for i in range(num)))


def use(params: float, grads: float, optimizer: float, activations: float, comm: float = 0) -> MemoryUse:
    """A breakdown given in MiB."""
    return MemoryUse(params=int(params * MiB), grads=int(grads * MiB), optimizer=int(optimizer * MiB),
                     activations=int(activations * MiB), comm=int(comm * MiB))


# one stage of all four nodes: P = G = 10, S = 20, A = 5 MiB, inputs 0.875 MiB; the largest cell 4 MiB,
# the largest activations 2 MiB (node 3 both). The transport's frames: 1.5 x the largest bucket (node 3's
# gradient): 6 MiB; 0.5 x a node's bucket under ZeRO-2/3 (the reduce-scatter reduces in its input).
# Units of 4 MiB: nodes 0-1 (3 MiB), node 2, node 3. ZeRO-1/2's gather at node 3: its bucket (4) and
# its neighbour's (3), each a segment (1 / F) and the whole bucket; ZeRO-2's packed gradients (10,
# summed) and the larger of a node's gradient and the gather less it, with its frames: at node 2
# 1.5 x (3 + 4) - 3 and 0.5 x 3 (9), above node 3's 1.5 x 7 - 4 and 0.5 x 4 (8.5);
# ZeRO-3, the larger of a unit's forward (2 U + its neighbour) and backward (U + its neighbour + 2 G +
# the next unit's G): at node 2, gathered 2 x 3 + 4 and the backward's 2 x 3 + 4 - 3 more, frames
# 0.5 x 3 (18.5); at node 3, 2 x 4 + 3 and 2 x 4 - 4 more, frames 2 (17); with recompute each adds its
# A, and node 2 (19.5) stays above node 3 (19)
ONE_STAGE = [
    # (replicas, zero, shard factor, recompute) -> the worker's breakdown
    (2, 0, None, False, use(10, 10, 20, 5, 6)),
    (2, 1, None, False, use(10, 10, 20 / 2, 5, 1.5 * 7 + 6)),
    (2, 2, None, False, use(10, 10 / 2, 20 / 2, 5, 10 + (1.5 * 7 - 3) + 0.5 * 3)),
    (2, 3, None, False, use(10 / 2 + 2 * 3 + 4, 10 / 2, 20 / 2, 5, (2 * 3 + 4 - 3) + 0.5 * 3)),
    (2, 0, None, True, use(10, 10, 20, 0.875 + 2, 6)),
    (2, 3, None, True, use(10 / 2 + 2 * 3 + 4, 10 / 2, 20 / 2, 0.875 + 1, (2 * 3 + 4 - 3) + 0.5 * 3)),
    (4, 1, None, False, use(10, 10, 20 / 4, 5, 1.25 * 7 + 6)),
    (4, 2, None, False, use(10, 10 / 4, 20 / 4, 5, 10 + (1.25 * 7 - 3) + 0.5 * 3)),
    (4, 3, None, False, use(10 / 4 + 2 * 3 + 4, 10 / 4, 20 / 4, 5, (2 * 3 + 4 - 3) + 0.5 * 3)),
    # hybrid: groups of 2, replicated
    (4, 2, 2, False, use(10, 10 / 2, 20 / 2, 5, 10 + (1.5 * 7 - 3) + 0.5 * 3)),
]


@pytest.mark.parametrize(("d", "zero", "factor", "recompute", "expected"), ONE_STAGE)
def test_one_stage_per_worker_memory_by_hand(d: int, zero: int, factor: int | None, recompute: bool,
                                             expected: MemoryUse) -> None:
    request = PlanConfig(data_parallel=d, num_stages=1, num_microbatches=1, schedule="gpipe",
                         mode="collective", zero=zero, shard_factor=factor, recompute=recompute,
                         offload=False)
    plan = choose_plan(model(), cpu(d), request, global_batch=4 * d)  # microbatch 4: the profiled one
    factor = factor or (d if zero else 1)
    assert (plan.zero_stage, plan.shard_factor, plan.recompute) == (zero, factor, recompute)
    assert plan.stages[0].memory == expected
    assert plan.peak_memory_bytes == plan.stages[0].peak_memory_bytes == expected.total
    assert plan.fullest_memory() == (0, expected)
    assert Plan.from_json(plan.to_json()) == plan


# two stages (nodes 0-1: P 3, A 2, inputs 0.25; nodes 2-3: P 7, A 3, inputs 0.625 MiB), 2 replicas, GPipe of
# 2 microbatches (2 in flight); the gradients accumulate whole over the microbatches. Frames: 1.5 x the
# stage's largest gradient (3 and 6 MiB), 0.5 x the node's under ZeRO-2/3. Units of 4 MiB: nodes 0-1 (3
# MiB), node 2, node 3; a unit's neighbour counts across the stage's edge (node 2's for nodes 0-1: an upper
# bound). ZeRO-1/2's gather: 1.5 x (3 + 3) in stage 0, 1.5 x (4 + 3) at node 3; ZeRO-2 holds the gradients
# whole (2 microbatches) and their packed copies, and peaks at nodes 0 and 2 (the gather less their
# gradient, their frames); ZeRO-3: units 0-1 gathered twice and node 2's prefetched (2 x 3 + 3), in the
# backward their gradient twice and node 2's in flight less the unit (2 x 3 + 3 - 3); stage 1 peaks at node
# 2 (2 x 3 + 4 gathered, 2 x 3 + 4 - 3 more in the backward, frames 0.5 x 3)
PIPELINE = [
    (0, False, [use(3, 3, 6, 2 * 2, 3), use(7, 7, 14, 3 * 2, 6)]),
    (1, False, [use(3, 3, 6 / 2, 4, 1.5 * 6 + 3), use(7, 7, 14 / 2, 6, 1.5 * 7 + 6)]),
    (2, False, [use(3, 3, 6 / 2, 4, 3 + (1.5 * 6 - 1) + 0.5 * 1),
                use(7, 7, 14 / 2, 6, 7 + (1.5 * 7 - 3) + 0.5 * 3)]),  # whole grads, as ZeRO-1
    (3, False, [use(3 / 2 + 2 * 3 + 3, 3, 6 / 2, 4, (2 * 3 + 3 - 3) + 0.5 * 2),
                use(7 / 2 + 2 * 3 + 4, 7, 14 / 2, 6, (2 * 3 + 4 - 3) + 0.5 * 3)]),
    (0, True, [use(3, 3, 6, 0.25 * 2 + 1, 3), use(7, 7, 14, 0.625 * 2 + 2, 6)]),
]


@pytest.mark.parametrize(("zero", "recompute", "expected"), PIPELINE)
def test_pipeline_per_worker_memory_by_hand(zero: int, recompute: bool, expected: list[MemoryUse]) -> None:
    request = PlanConfig(data_parallel=2, num_stages=2, balance=[2, 2], num_microbatches=2, schedule="gpipe",
                         mode="collective", zero=zero, recompute=recompute, offload=False)
    plan = choose_plan(model(), cpu(4), request, global_batch=16)
    assert [st.in_flight for st in plan.stages] == [2, 2]
    assert [st.memory for st in plan.stages] == expected
    assert [st.peak_memory_bytes for st in plan.stages] == [m.total for m in expected]
    assert plan.peak_memory_bytes == max(m.total for m in expected)
    assert f"memory of the fullest worker (w1, stage 1): {expected[1].text()}" in str(plan)


def test_offload_empties_the_device_of_optimizer_state_on_cuda_workers_only() -> None:
    """On a CUDA worker the state leaves the device; on a CPU worker it stays and the host copy of the
    parameters (this worker's rows) comes on top: planned, not refused (the driver warns)."""
    request = PlanConfig(data_parallel=2, num_stages=1, num_microbatches=1, schedule="gpipe",
                         mode="collective", zero=1, offload=True)
    plan = choose_plan(model(), cuda(2), request, global_batch=8)
    assert plan.offload and plan.stages[0].memory == use(10, 10, 0, 5, 1.5 * 7 + 6)
    # the step: gradients down and parameters up (a shard each), the update on the host
    kept = choose_plan(model(), cuda(2), request.model_copy(update={"offload": False}), global_batch=8)
    assert plan.stages[0].optimizer_s > kept.stages[0].optimizer_s
    assert plan.stages[0].optimizer_s > (10 + 10) * MiB / 2 / OFFLOAD_BANDWIDTH_BPS
    on_cpu = choose_plan(model(), cpu(2), request, global_batch=8)
    kept = choose_plan(model(), cpu(2), request.model_copy(update={"offload": False}), global_batch=8)
    assert on_cpu.offload and on_cpu.stages[0].memory == kept.stages[0].memory + use(0, 0, 10 / 2, 0)


def test_sharding_shrinks_the_optimizer_step_and_moves_the_sync_bytes() -> None:
    base = PlanConfig(data_parallel=4, num_stages=1, num_microbatches=1, schedule="gpipe", mode="collective")
    plans = {z: choose_plan(model(), cpu(4), base.model_copy(update={"zero": z}), global_batch=16)
             for z in (0, 1, 2, 3)}
    for z in (1, 2, 3):
        assert plans[z].stages[0].optimizer_s == pytest.approx(plans[0].stages[0].optimizer_s / 4)
    # the replicated optimizer step runs before the first action: its saving comes off the pipeline
    saved = plans[0].stages[0].optimizer_s * 3 / 4
    assert plans[1].pipeline_time_s == pytest.approx(plans[0].pipeline_time_s - saved)
    bw, lat = COLLECTIVE_EFFICIENCY * cpu(4).bandwidth_bps, cpu(4).latency_s
    gather = ring_pass(10 * MiB, 4, bw, lat)
    # ZeRO-1 adds the parameters' all-gather to the all-reduce, behind the next forward in 3 buckets of
    # at most 4 MiB: the first exposed, the others hidden by the forward, half of them at most
    bucket = ring_pass(10 * MiB / 3, 4, bw, lat)
    for z in (1, 2):
        one = MemoryOption(zero=z, shard_factor=4)
        assert sharded_sync(one, 4, 0.0, 10 * MiB, hidden=0.0, compute_s=0.0, num_microbatches=1,
                            bandwidth=bw, latency=lat) == pytest.approx(3 * bucket)
        assert sharded_sync(one, 4, 0.0, 10 * MiB, hidden=0.0, compute_s=1e9, num_microbatches=1,
                            bandwidth=bw, latency=lat) == pytest.approx(bucket + bucket)
    after = plans[1].sync_time_s - plans[0].sync_time_s
    assert 2 * bucket - 1e-12 <= after <= 3 * bucket + 1e-12
    # ZeRO-2 halves the all-reduce into a reduce-scatter (hidden as the all-reduce is) and that all-gather
    hidden = 2 * ring_pass(10 * MiB, 4, bw, lat) - plans[0].sync_time_s
    assert plans[2].sync_time_s == pytest.approx(max(0.0, ring_pass(10 * MiB, 4, bw, lat) - hidden) + after)
    # ZeRO-3 gathers in each forward and backward, half hidden by prefetch at most
    option = candidate_plans(model(), cpu(4), base.model_copy(update={"zero": 3}), global_batch=16)[0].option
    scatter = ring_pass(10 * MiB, 4, bw, lat)
    assert sharded_sync(option, 4, 10 * MiB, 10 * MiB, hidden=0.0, compute_s=0.0, num_microbatches=2,
                        bandwidth=bw, latency=lat) == pytest.approx(scatter + 4 * gather)
    assert sharded_sync(option, 4, 10 * MiB, 10 * MiB, hidden=0.0, compute_s=1e9, num_microbatches=2,
                        bandwidth=bw, latency=lat) == pytest.approx(scatter + 2 * gather)


def one_cell(params: int) -> Profile:
    """A model that cannot be cut: one cell holding one parameter of ``params`` bytes, Adam (its step's
    temporaries twice the parameter)."""
    made = Profile.synthetic([1e-3], param_bytes=[params], activation_bytes=[MiB], microbatch_size=4)
    node = made.nodes[0].model_copy(update={"step_temporary_bytes": 2 * params,
                                            "largest_param_bytes": params})
    return made.model_copy(update={"nodes": (node,)})


def test_a_model_too_big_to_replicate_gets_a_zero_plan() -> None:
    # 64 MiB of parameters over 2 collective replicas: 385 MiB replicated (the step's temporaries, 128 MiB,
    # and the frames, 96, take turns) and ZeRO-1 385 (its gather buffers and frames, 192, and half the
    # state); ZeRO-2 321 (frames 0.5 x: 32, its packed gradient 64 and the gather less it 64) and ZeRO-3
    # 353 (its unit gathered, and its gradient buffers)
    res = cpu(2, 360 * MiB)
    collective = PlanConfig(mode="collective", data_parallel=2)
    plan = choose_plan(one_cell(64 * MiB), res, collective, global_batch=8,
                       automatic=Automatic(zero=(0, 1, 2, 3)))
    assert plan.zero_stage in (2, 3) and plan.data_parallel == 2 and plan.shard_factor == 2
    assert plan.peak_memory_bytes <= 360 * MiB
    assert choose_plan(one_cell(64 * MiB), res, collective, global_batch=8) == plan  # AUTOMATIC
    # a search limited to replicated state cannot hold it: refused, naming the least it needs
    with pytest.raises(PlanningError, match=r"no plan fits in memory .* needs is 38\d MiB per worker"):
        choose_plan(one_cell(64 * MiB), res, collective, global_batch=8, automatic=Automatic())


def test_a_model_that_fits_keeps_the_fastest_plan() -> None:
    # a long backward after the first bucket (the last two cells' 32 MiB) hides the whole all-reduce:
    # sharding adds an all-gather after the step (32 MiB at 3 GB/s: 11 ms) that costs more than the
    # optimizer time it saves (Adam over half of 64 MiB at 25 GB/s: 9.4 ms)
    slow = Profile.synthetic([0.1] * 4, param_bytes=[16 * MiB] * 4, activation_bytes=[MiB] * 4,
                             cut_bytes=[64 * KiB] * 3, microbatch_size=2)
    request = PlanConfig(data_parallel=2, num_stages=1)
    plain = choose_plan(slow, cpu(2), request, global_batch=8)
    assert choose_plan(slow, cpu(2), request, global_batch=8, automatic=EVERY) == plain
    assert plain.zero_stage == 0
    # a short one (the collectives start with the last cell's gradient, and the cells before it are
    # quick) hides little of it: ZeRO-2's reduce-scatter hides as much, its gather (behind the next
    # forward) costs less than the all-reduce's second half did, and the optimizer steps 1/2 of the
    # stage: faster; the planner still takes the replicated plan, which fits (sharding is what it
    # reaches for when memory runs out: [Note: what the automatic search may pick])
    short = Profile.synthetic([1e-3] * 4, backward_s=[2e-4, 2e-4, 2e-4, 6e-3],
                              param_bytes=[MiB, 2 * MiB, 3 * MiB, 4 * MiB],
                              activation_bytes=[MiB, MiB, MiB, 2 * MiB],
                              cut_bytes=[256 * KiB, 512 * KiB, 128 * KiB], microbatch_size=4)
    every = candidate_plans(short, cpu(2), request, global_batch=16, automatic=EVERY, exhaustive=True)
    fast = min((c for c in every if c.fits), key=lambda c: c.step_time_s).plan
    replicated = choose_plan(short, cpu(2), request, global_batch=16, automatic=EVERY)
    assert fast is not None and (fast.zero_stage, replicated.zero_stage) == (2, 0)
    assert fast.step_time_s < replicated.step_time_s
    assert fast.sync_time_s < replicated.sync_time_s
    assert choose_plan(short, cpu(2), request.model_copy(update={"zero": 2}), global_batch=16) == fast


def test_fixed_fields_pass_through_whatever_the_search_may_choose() -> None:
    plan = choose_plan(model(), cpu(4), PlanConfig(zero=3, recompute=True), global_batch=16)
    assert (plan.zero_stage, plan.shard_factor, plan.recompute) == (3, plan.data_parallel, True)
    never = choose_plan(model(), cpu(4), PlanConfig(zero=0, recompute=False), global_batch=16,
                        automatic=EVERY)
    assert (never.zero_stage, never.recompute) == (0, False)


def test_the_candidates_table_shows_the_option_and_the_breakdown() -> None:
    cands = candidate_plans(model(), cpu(2), PlanConfig(data_parallel=2, num_stages=1, num_microbatches=1),
                            global_batch=8, automatic=EVERY)
    assert {c.option.label() for c in cands} >= {"-", "Z1/2", "Z2/2", "Z3/2"}
    table = format_candidates(cands, limit=20)
    assert "opt state" in table.splitlines()[0]
    row = next(line for line in table.splitlines() if " Z3/2 " in line)
    assert "15 MiB" in row and "5 MiB" in row and "10 MiB" in row  # parameters, gradients, optimizer state


GRID = [(prof, res, budget, batch)
        for prof in ("uniform", "uneven")
        for res, budget in (("cpu2", 1 << 40), ("cpu2", 40 * MiB), ("cpu4", 30 * MiB), ("cpu4", 18 * MiB),
                            ("cuda2", 24 * MiB), ("cuda4", 12 * MiB))
        for batch in (8, 16)]


def grid_profile(name: str) -> Profile:
    if name == "uniform":
        return Profile.synthetic([1e-3] * 4, param_bytes=[2 * MiB] * 4, activation_bytes=[MiB] * 4,
                                 cut_bytes=[64 * KiB] * 3, microbatch_size=2)
    return model()


@pytest.mark.parametrize(("prof", "res", "budget", "batch"), GRID)
def test_the_pruned_search_chooses_as_the_exhaustive_one(prof: str, res: str, budget: int,
                                                         batch: int) -> None:
    workers = (cpu if res.startswith("cpu") else cuda)(int(res[-1]), budget)
    request = PlanConfig(max_microbatches=4)
    outcomes = []
    for exhaustive in (False, True):
        try:
            outcomes.append(choose_plan(grid_profile(prof), workers, request, global_batch=batch,
                                        automatic=EVERY, exhaustive=exhaustive))
        except PlanningError as exc:
            outcomes.append(str(exc).split(" (")[0])
    assert outcomes[0] == outcomes[1]
    pruned = candidate_plans(grid_profile(prof), workers, request, global_batch=batch, automatic=EVERY)
    every = candidate_plans(grid_profile(prof), workers, request, global_batch=batch, automatic=EVERY,
                            exhaustive=True)
    assert len(pruned) <= len(every)


def test_the_grid_needs_the_memory_options() -> None:
    """The grid is not vacuous: some of its cases choose ZeRO, recompute or offload."""
    chosen = set()
    for prof, res, budget, batch in GRID:
        workers = (cpu if res.startswith("cpu") else cuda)(int(res[-1]), budget)
        try:
            plan = choose_plan(grid_profile(prof), workers, PlanConfig(max_microbatches=4),
                               global_batch=batch, automatic=EVERY)
        except PlanningError:
            continue
        chosen.add((plan.zero_stage > 0, plan.recompute, plan.offload))
    assert len(chosen) >= 3, chosen


def test_the_cutter_counts_a_stage_s_largest_transient_bytes() -> None:
    rng = random.Random(7)
    for _ in range(200):
        n, k = rng.randint(2, 7), rng.randint(1, 3)
        k = min(k, n)
        problem = CutProblem(tuple(rng.uniform(0.1, 1) for _ in range(n)), (0.0,) * (n + 1), k,
                             static_bytes=tuple(float(rng.randint(1, 5)) for _ in range(n)),
                             activation_bytes=tuple(float(rng.randint(0, 3)) for _ in range(n)),
                             in_flight=tuple(rng.randint(1, 3) for _ in range(k)),
                             memory_limit=tuple(float(rng.randint(8, 30)) for _ in range(k)),
                             transient_bytes=tuple(float(rng.randint(0, 9)) for _ in range(n)))
        feasible = []
        for inner in itertools.combinations(range(1, n), k - 1):
            bounds = (0, *inner, n)
            if all(problem.stage_memory(s, bounds[s], bounds[s + 1]) <= problem.memory_limit[s]  # type: ignore[index]
                   for s in range(k)):
                feasible.append(problem.max_stage_time(bounds))
        if not feasible:
            with pytest.raises(ValueError):
                problem.check(cut_min_max(problem))
            continue
        assert problem.max_stage_time(problem.check(cut_min_max(problem))) == pytest.approx(min(feasible))


def cells(count: int, params: int) -> list[CellBytes]:
    return [CellBytes(name=f"c{i}", num_params=params // 4, param_bytes=params, buffer_bytes=0,
                      trainable_bytes=params) for i in range(count)]


def test_the_memory_floor_counts_the_zero_stages_the_planner_may_use() -> None:
    # two cells of 16 MiB, Adam, 4 workers. Without ZeRO the least is parameter-server mode on 2 x 2:
    # 16 + 16 + (32 + 16) / 2 = 56 MiB; with ZeRO-3 over 2 replicas x 2 stages, 8 + 8 + 16 = 32 MiB
    # (over 4 replicas x 1 stage it would be 2 x (4 + 4 + 8) + the 2 gathered cells' 32 = 64 MiB)
    assert memory_floor(cells(2, 16 * MiB), 4, "adam") == (56 * MiB,
                                                           "2 replica(s) x 2 stage(s), parameter_server")
    need, shape = memory_floor(cells(2, 16 * MiB), 4, "adam", zero=(0, 1, 2, 3))
    assert (need, shape) == (32 * MiB, "2 replica(s) x 2 stage(s), collective, ZeRO-3")
    # offloaded, the optimizer state leaves: ZeRO-3 then holds 8 + 8 per cell
    assert memory_floor(cells(2, 16 * MiB), 4, "adam", zero=(0, 3), offload=True)[0] == 16 * MiB
    res = cpu(4, 40 * MiB)
    sharded = r"sharding its state would bring it to 32 MiB per worker .*ZeRO-3\): leave plan\.zero open"
    with pytest.raises(PlanningError, match=r"too big for these workers.*" + sharded):
        check_memory_floor(cells(2, 16 * MiB), res, "adam", PlanConfig(zero=0))
    check_memory_floor(cells(2, 16 * MiB), res, "adam")  # the planner may shard it: not refused
    check_memory_floor(cells(2, 16 * MiB), res, "adam", PlanConfig(zero=3))  # a sharded plan, not an error


def test_the_optimizer_steps_temporaries_are_a_transient_sharded_with_the_state() -> None:
    """Adam's step needs twice its largest parameter at once: counted as a node's transient, the larger of it
    and the node's other transients (ZeRO-3's gathered cells, ZeRO-1/2's gather buffers: 1.5 x the bucket,
    both nodes, one unit of 4000 B; the transport's frames: 1.5 x the largest gradient, 4500 B, 0.5 x under
    ZeRO-2/3), on this worker's rows under ZeRO, nowhere when offloaded."""
    from coordinator.planning.memory import MemoryOption, node_memory
    from coordinator.planning.profile import NodeProfile

    def node(name: str, p: int, largest: int) -> NodeProfile:
        return NodeProfile(name=name, forward_s=1e-3, backward_s=2e-3, param_bytes=p, grad_bytes=p,
                           optimizer_state_bytes=2 * p, activation_bytes=100,
                           step_temporary_bytes=2 * largest)

    def b(params: int, grads: int, optimizer: int, activations: int, comm: int) -> MemoryUse:
        return MemoryUse(params=params, grads=grads, optimizer=optimizer, activations=activations, comm=comm)

    nodes = [node("a", 1000, 600), node("b", 3000, 1000)]

    def peak(option: MemoryOption, on_cuda: bool = False) -> MemoryUse:
        mem = node_memory(nodes, option, mode="collective", data_parallel=2, num_microbatches=1,
                          activation_bytes=[100, 100], input_bytes=[10, 10], on_cuda=on_cuda)
        return mem.stage(0, 2, mem.held, 1)

    # the step's temporaries (2000) take turns with the frames (4500): the larger counts
    assert peak(MemoryOption()) == b(4000, 4000, 8000, 200, 4500)
    # ZeRO-1/2: the step's temporaries (1000) are less than the gather's buffers (6000)
    assert peak(MemoryOption(zero=1, shard_factor=2)) == b(4000, 4000, 4000, 200, 6000 + 4500)
    # ZeRO-2: its packed gradients (4000) and, at a, the gather less a's gradient (5000) and a's frames
    # (0.5 x 1000: a reduce-scatter reduces in its input)
    assert peak(MemoryOption(zero=2, shard_factor=2)) == b(4000, 2000, 4000, 200, 4000 + 5000 + 500)
    # ZeRO-3 gathers the unit of both twice (8000 B) in the forward; its backward holds it once and its
    # gradient twice (12000 B: 4000 more); more than its step's 1000. In units of one node, b and its
    # neighbour gathered (7000 B), then b's gradient twice less b once (3000 more)
    assert peak(MemoryOption(zero=3, shard_factor=2)) == b(2000 + 8000, 2000, 4000, 200, 4000 + 1500)
    assert peak(MemoryOption(zero=3, shard_factor=2, gather_bytes=1)) == b(2000 + 7000, 2000, 4000, 200,
                                                                          3000 + 1500)
    assert peak(MemoryOption(offload=True), on_cuda=True) == b(4000, 4000, 0, 200, 4500)
    assert peak(MemoryOption(offload=True), on_cuda=True).total < peak(MemoryOption()).total
    # on the CPU the state and the step stay, and the master copy of the parameters comes on top
    assert peak(MemoryOption(offload=True)) == b(4000, 4000, 8000 + 4000, 200, 4500)
    assert peak(MemoryOption(zero=3, shard_factor=2, offload=True)) == b(2000 + 8000, 2000, 4000 + 2000, 200,
                                                                       4000 + 1500)


def test_the_replicated_static_sum_is_the_node_memorys() -> None:
    """``replicated_static`` (what the search reads before it places a shape) against ``node_memory``'s
    static bytes summed, for each mode, replica count, microbatch count and device, on random nodes with
    buffers and optimizer state."""
    rng = random.Random(41)
    for _ in range(20):
        n = rng.randint(1, 30)
        base = Profile.synthetic([1e-3] * n, param_bytes=[rng.randint(0, 10**8) for _ in range(n)],
                                 activation_bytes=[10**6] * n)
        nodes = tuple(nd.model_copy(update={"buffer_bytes": rng.randint(0, 10**6),
                                            "optimizer_state_bytes": rng.randint(0, 3 * 10**8)})
                      for nd in base.nodes)
        for mode, d, m, on_cuda in itertools.product(("collective", "parameter_server"), (1, 2, 3, 64),
                                                      (1, 4), (False, True)):
            whole = node_memory(nodes, REPLICATED, mode=mode, data_parallel=d, num_microbatches=m,
                                activation_bytes=[0.0] * n, input_bytes=[0.0] * n, on_cuda=on_cuda)
            fixed, shared = replicated_static(nodes, mode, d)
            assert fixed + shared / d == pytest.approx(sum(whole.static), rel=1e-13, abs=1e-6)
