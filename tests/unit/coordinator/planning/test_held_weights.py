"""Held weight gradients priced at the rows a flush has, and the predicted timeline pricing them alike.

See [Note: a flush's rows] in ``coordinator/planning/profile.py`` and [Note: the backward as the schedule
runs it] in ``coordinator/planning/planner.py``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from coordinator.planning.config import PlanConfig
from coordinator.planning.graph import build_graph
from coordinator.planning.planner import ACTION_OVERHEAD_S, choose_plan
from coordinator.planning.prediction import plan_costs, predict
from coordinator.planning.profile import FLUSH_FACTOR, SCALE_FACTOR, Profile, profile_graph
from coordinator.planning.resources import Resources, Worker
from coordinator.planning.simulator import simulate
from services.compute.weight_grads import WeightGradStore

MiB = 1 << 20


def test_a_flush_past_the_larger_size_follows_its_timed_rows() -> None:
    """Affine from the two sizes up to ``SCALE_FACTOR``; past it the line through the fit's value there and
    the flush timed at ``weight_flush_scale``; without a flush timed, affine throughout."""
    base = Profile.synthetic([1e-3], backward_s=[2e-3]).nodes[0]
    node = base.model_copy(update={"input_backward_s": 1e-3, "weight_s": 1e-3, "weight_fixed_s": 0.8e-3})
    at4 = 0.8e-3 + 0.2e-3 * SCALE_FACTOR  # 1.6 ms: the affine fit's upper point
    assert node.halves_at(8.0)[1] == pytest.approx(0.8e-3 + 0.2e-3 * 8)
    flushed = node.model_copy(update={"weight_flush_s": 6e-3, "weight_flush_scale": 16.0})
    assert flushed.halves_at(1.0) == node.halves_at(1.0)
    assert flushed.halves_at(SCALE_FACTOR) == pytest.approx(node.halves_at(SCALE_FACTOR))
    assert flushed.halves_at(8.0)[1] == pytest.approx(at4 + (6e-3 - at4) * 4 / 12)
    assert flushed.halves_at(16.0)[1] == pytest.approx(6e-3)
    assert flushed.halves_at(32.0)[1] == pytest.approx(at4 + (6e-3 - at4) * 28 / 12)
    assert flushed.halves_at(8.0)[0] == node.halves_at(8.0)[0]  # the I is not touched


def test_a_repeated_microbatch_flushes_as_that_many_of_its_rows() -> None:
    """``WeightGradStore.repeat`` queues a microbatch's rows again: one flush of ``k`` copies adds ``k`` times
    its weight gradient (float64, against autograd's)."""
    torch.manual_seed(0)
    layer = nn.Linear(6, 5).double()
    x = torch.randn(4, 6, dtype=torch.float64)
    layer(x).sum().backward()
    assert layer.weight.grad is not None and layer.bias.grad is not None
    want_w, want_b = layer.weight.grad.clone(), layer.bias.grad.clone()
    store = WeightGradStore(layer)
    with store.deferring():
        store.microbatch = 0
        out = layer(x)
        store.microbatch = None
        out.sum().backward()
        store.repeat(0, [1, 2, 3])
        assert store.pending() == [0, 1, 2, 3]
        store.flush([0], check=False)  # in place: the .grad the plain backward left, now twice
        store.flush([1, 2, 3], check=False)  # one product over three copies of the rows
    assert (layer.weight.grad - 5 * want_w).abs().max().item() < 1e-12
    assert (layer.bias.grad - 5 * want_b).abs().max().item() < 1e-12


def test_the_profile_times_the_flush_of_a_linear_node_at_its_rows() -> None:
    """Each node with a linear layer gets its ``W`` timed at ``FLUSH_FACTOR`` times the sample's rows, and its
    halves at that size are that time; a node without one gets none; no gradient is left behind."""
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    sample = torch.randn(4, 32)
    prof = profile_graph(build_graph(model, sample), sample, repeats=2, num_threads=1)
    for nd in prof.nodes:
        if nd.split:
            assert nd.weight_flush_s > 0 and nd.weight_flush_scale == FLUSH_FACTOR
            assert nd.halves_at(FLUSH_FACTOR)[1] == pytest.approx(nd.weight_flush_s)
        else:
            assert nd.weight_flush_s == 0
    assert any(nd.split for nd in prof.nodes)
    assert all(p.grad is None for p in model.parameters())


def test_the_predicted_timeline_prices_the_tail_as_the_plan() -> None:
    """A GPipe plan keeps each stage's tail (the one product after the last send) and the predicted timeline
    (``plan_costs``) plays it: on workers of their own hosts it gives the planner's pipeline step, and
    without the tail it would be shorter; a zb-h1 plan keeps its ``W``."""
    base = Profile.synthetic([1e-3] * 4, backward_s=[2e-3] * 4, param_bytes=[MiB] * 4, microbatch_size=4)
    nodes = tuple(nd.model_copy(update={"input_backward_s": 0.9e-3, "weight_s": 0.8e-3,
                                        "input_backward_fixed_s": 0.45e-3, "weight_fixed_s": 0.4e-3})
                  for nd in base.nodes)
    prof = base.model_copy(update={"nodes": nodes})
    res = Resources(workers=tuple(Worker(name=f"w{i}", memory_bytes=1000 * MiB, host=f"h{i}")
                                  for i in range(2)))
    fixed = PlanConfig(num_stages=2, data_parallel=1, num_microbatches=8, schedule="gpipe", balance=[2, 2])
    plan = choose_plan(prof, res, fixed, global_batch=32)
    costs = plan_costs(plan)
    assert costs.tail_s == tuple(s.tail_s for s in plan.stages)
    assert all(t > 0 for t in costs.tail_s)
    step = predict(plan).step_time_s
    assert step == pytest.approx(plan.pipeline_time_s, rel=1e-9)
    without = simulate(plan.schedule(), dataclasses.replace(costs, tail_s=())).step_time_s
    assert without < step - 0.5 * costs.tail_s[0]
    zb = choose_plan(prof, res, fixed.model_copy(update={"schedule": "zb-h1"}), global_batch=32)
    assert plan_costs(zb).weight_backward_s == tuple(s.weight_s for s in zb.stages)
    assert all(s.weight_s > ACTION_OVERHEAD_S for s in zb.stages)
