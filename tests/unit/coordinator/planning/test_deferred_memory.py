"""The planner counts what a stage deferring its weight gradients holds (``compute/weight_grads.py``).

Which lists defer (zb-h1's, GPipe's of two or more microbatches; not 1F1B's interleaved ones), what
the profile measures per node (each deferred linear call's input and output), and the peak memory
of a plan: ``in_flight`` microbatches of the larger of activations and deferred bytes per node on a
stage that defers, of activations on one that does not.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from coordinator.planning.config import PlanConfig
from coordinator.planning.graph import build_graph
from coordinator.planning.planner import choose_plan
from coordinator.planning.profile import Profile, profile_graph
from coordinator.planning.resources import Resources, Worker
from coordinator.planning.schedules import build_schedule
from services.compute.cell import Cell
from services.compute.weight_grads import defers

MiB = 2**20


@pytest.mark.parametrize(("name", "p", "m", "expected"), [
    ("zb-h1", 2, 4, [True, True]),
    ("gpipe", 2, 4, [True, True]),
    ("gpipe", 2, 1, [False, False]),  # one microbatch: nothing to batch (data parallel keeps its overlap)
    ("1f1b", 2, 4, [False, False]),
    ("1f1b", 4, 2, [True, True, True, False]),  # warm-up covers every forward: GPipe's shape
])
def test_which_lists_defer(name: str, p: int, m: int, expected: list[bool]) -> None:
    assert [defers(acts) for acts in build_schedule(name, p, m).actions] == expected


def test_the_profile_counts_each_deferred_linear_call_s_input_and_output() -> None:
    frozen = nn.Linear(8, 8)
    frozen.requires_grad_(False)
    cells = [Cell("a", nn.Sequential(nn.Linear(5, 8), nn.Tanh())),
             Cell("b", nn.Sequential(frozen, nn.Tanh())), Cell("c", nn.Linear(8, 3))]
    sample = torch.randn(4, 5)
    prof = profile_graph(build_graph(cells, sample), sample, repeats=1, warmup=0)
    assert [nd.deferred_bytes for nd in prof.nodes] == [4 * (5 + 8) * 4, 0, 4 * (8 + 3) * 4]
    assert all(nd.activation_bytes > 0 for nd in prof.nodes)


def profile(deferred: int) -> Profile:
    return Profile.synthetic([1e-3] * 4, param_bytes=[MiB] * 4, activation_bytes=[MiB] * 4,
                             deferred_bytes=[deferred] * 4, cut_bytes=[1024] * 3, microbatch_size=1)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_a_stage_that_defers_holds_the_larger_of_activations_and_deferred_bytes(schedule: str) -> None:
    res = Resources(workers=tuple(Worker(name=f"w{i}", memory_bytes=1 << 40, host="h") for i in range(2)))
    config = PlanConfig(num_stages=2, data_parallel=1, num_microbatches=4, schedule=schedule, balance=[2, 2])
    small, large = (choose_plan(profile(d), res, config, global_batch=4) for d in (MiB // 2, 3 * MiB))
    for plan in (small, large):
        in_flight = {"gpipe": [4, 4], "1f1b": [2, 1], "zb-h1": [2, 2]}[schedule]
        assert [st.in_flight for st in plan.stages] == in_flight
    deferring = schedule != "1f1b"
    # 1F1B instead holds its 4 B's W's rows per node: up to 1/8 of its 1 MiB of weights and the microbatch
    # that crosses it (see the test below)
    held = [0 if deferring else 2 * min(4 * d, MiB // 8 + d) for d in (MiB // 2, 3 * MiB)]
    for s, (a, b) in enumerate(zip(small.stages, large.stages, strict=True)):
        # static: parameters, gradients and Adam's state of 2 nodes of 1 MiB each
        static = 2 * MiB * 4
        assert a.peak_memory_bytes == static + 2 * MiB * a.in_flight + held[0]
        assert b.peak_memory_bytes == static + 2 * (3 * MiB if deferring else MiB) * b.in_flight + held[1], s


def test_a_1f1b_stage_counts_the_rows_of_its_held_weight_gradients() -> None:
    """1F1B's B's hold their W's rows until they exceed 1/8 of the stage's deferred weights (the microbatch
    that crosses included: [Note: a backward's weight gradients in place] in weight_grads.py). Per node
    here: 1 MiB of weights (a limit of 128 KiB), 48 KiB of rows a microbatch. Worked out by hand: a replica
    alone holds every B's, so 8 microbatches hold at most 128 + 48 KiB (the third crosses); 3 microbatches
    144 KiB (2 would run as GPipe's shape on stage 0, deferring). GPipe defers instead (counted as before),
    mixed precision holds nothing."""
    def peak(rows: int, m: int, schedule: str = "1f1b", precision: str = "fp32") -> int:
        prof = Profile.synthetic([1e-3] * 4, param_bytes=[MiB] * 4, deferred_bytes=[rows] * 4,
                                 activation_bytes=[1000] * 4, microbatch_size=1)
        res = Resources(workers=tuple(Worker(name=f"w{i}", memory_bytes=1000 * MiB) for i in range(2)))
        plan = choose_plan(prof, res, PlanConfig(num_stages=2, data_parallel=1, num_microbatches=m,
                                                 schedule=schedule, balance=[2, 2], precision=precision),
                           global_batch=m)
        assert plan.stages[0].memory.total == plan.stages[0].peak_memory_bytes
        return plan.stages[0].peak_memory_bytes

    KiB = 1024
    assert peak(48 * KiB, 8) - peak(0, 8) == 2 * (128 + 48) * KiB
    assert peak(48 * KiB, 3) - peak(0, 3) == 2 * 3 * 48 * KiB
    assert peak(48 * KiB, 8, "gpipe") - peak(0, 8, "gpipe") == 2 * 8 * (48 * KiB - 1000)
    assert peak(48 * KiB, 8, precision="bf16") == peak(0, 8, precision="bf16")
