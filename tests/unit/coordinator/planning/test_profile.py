"""Profiling: per-node times and bytes on a sample microbatch, and the profile round-tripping as JSON."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from torch import nn

from coordinator.planning.graph import build_graph
from coordinator.planning.profile import (
    SCALE_FACTOR,
    WINDOW_BYTES,
    NodeProfile,
    NodeTable,
    Profile,
    format_bytes,
    profile_graph,
)
from services.compute.cell import Cell


def mlp() -> list[Cell]:
    return [Cell("in", nn.Linear(16, 64)), Cell("act", nn.ReLU()), Cell("mid", nn.Linear(64, 64)),
            Cell("out", nn.Linear(64, 4))]


def test_profile_measures_every_node() -> None:
    model = mlp()
    sample = torch.randn(8, 16)
    graph = build_graph(model, sample)
    prof = profile_graph(graph, sample, repeats=3, optimizer="adam", num_threads=1)
    assert [n.name for n in prof.nodes] == ["in", "act", "mid", "out"]
    assert prof.microbatch_size == 8 and prof.repeats == 3 and prof.device == "cpu"
    assert all(n.forward_s > 0 and n.backward_s > 0 for n in prof.nodes)
    assert [n.param_bytes for n in prof.nodes] == [(16 * 64 + 64) * 4, 0, (64 * 64 + 64) * 4,
                                                   (64 * 4 + 4) * 4]
    assert all(n.optimizer_state_bytes == 2 * n.grad_bytes for n in prof.nodes)
    # Adam's step: two temporaries the size of the node's largest parameter (its weight)
    assert [n.step_temporary_bytes for n in prof.nodes] == [2 * 16 * 64 * 4, 0, 2 * 64 * 64 * 4,
                                                            2 * 64 * 4 * 4]
    # Linear(16, 64) saves its input (no grad needed for x, but the weight gradient needs it);
    # ReLU saves its output; the weights themselves are not activations
    assert prof.nodes[0].activation_bytes == 8 * 16 * 4
    assert prof.nodes[1].activation_bytes == 8 * 64 * 4
    assert [c.forward_bytes for c in prof.cuts] == [8 * 16 * 4, 8 * 64 * 4, 8 * 64 * 4, 8 * 64 * 4, 8 * 4 * 4]
    assert prof.cuts[0].backward_bytes == 0
    assert all(p.grad is None for c in model for p in c.parameters())  # profiling leaves no gradients


def test_profile_of_a_skip_model_relays_the_skip() -> None:
    class Res(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 8)
            self.c = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            return self.c(self.b(h)) + h

    sample = torch.randn(4, 8)
    prof = profile_graph(build_graph(Res(), sample), sample, repeats=1, warmup=0)
    assert [len(c.tensors) for c in prof.cuts] == [1, 1, 2, 1]


def test_profile_round_trips_through_json(tmp_path: Path) -> None:
    sample = torch.randn(4, 16)
    prof = profile_graph(build_graph(mlp(), sample), sample, repeats=2)
    assert Profile.model_validate_json(prof.model_dump_json()) == prof
    prof.save(tmp_path / "profile.json")
    assert Profile.load(tmp_path / "profile.json") == prof
    assert "mid" in str(prof)


def test_synthetic_profile_and_validation() -> None:
    prof = Profile.synthetic([1e-3, 2e-3, 3e-3], param_bytes=[100, 200, 300], cut_bytes=[64, 32])
    assert [c.forward_bytes for c in prof.cuts] == [0, 64, 32, 0]
    assert prof.nodes[2].backward_s == 6e-3 and prof.nodes[1].optimizer_state_bytes == 400
    data = prof.model_dump()
    data["cuts"] = data["cuts"][:-1]
    with pytest.raises(ValueError, match="need 4 cuts"):
        Profile.model_validate(data)
    with pytest.raises(ValueError, match="unknown optimizer"):
        profile_graph(build_graph(mlp(), torch.randn(2, 16)), torch.randn(2, 16), optimizer="lion")


def test_format_bytes() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(3 * 2**30) == "3 GiB"


def test_capture_and_profiling_leave_the_model_and_rng_untouched() -> None:
    model = [Cell("lin", nn.Linear(8, 8)), Cell("bn", nn.BatchNorm1d(8)), Cell("drop", nn.Dropout(0.5)),
             Cell("out", nn.Linear(8, 2))]
    stats = model[1].module.running_mean.clone()  # type: ignore[union-attr]
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    sample = torch.randn(16, 8) + 5.0
    torch.manual_seed(123)
    profile_graph(build_graph(model, sample), sample, repeats=2)
    assert torch.equal(torch.rand(3), expected)
    assert torch.equal(model[1].module.running_mean, stats)  # type: ignore[union-attr,arg-type]
    assert all(p.grad is None for c in model for p in c.parameters())


def test_times_are_affine_in_the_microbatch_size() -> None:
    # a node's fixed part does not grow with the microbatch; the rest grows linearly
    sample = torch.randn(8, 16)
    prof = profile_graph(build_graph(mlp(), sample), sample, repeats=3, num_threads=1)
    for nd in prof.nodes:
        assert 0 <= nd.forward_fixed_s <= nd.forward_s and 0 <= nd.backward_fixed_s <= nd.backward_s
    node = prof.nodes[0].model_copy(update={"forward_s": 3.0, "forward_fixed_s": 1.0, "backward_s": 2.0,
                                            "backward_fixed_s": 0.0})
    assert node.times_at(1.0) == (3.0, 2.0)
    assert node.times_at(4.0) == (1.0 + 2.0 * 4, 2.0 * 4)
    with pytest.raises(ValueError, match="fixed part exceeds"):
        prof.nodes[0].model_copy().model_validate({**prof.nodes[0].model_dump(), "forward_fixed_s": 1.0})


def test_a_warm_forward_is_timed_and_never_above_the_forward() -> None:
    """[Note: a warm forward]: each node's forward is also timed as a second microbatch's, at both sizes; a
    profile without it (written by hand, or before it) prices the forward for both."""
    sample = torch.randn(8, 16)
    prof = profile_graph(build_graph(mlp(), sample), sample, repeats=3, num_threads=1)
    for nd in prof.nodes:
        assert nd.warm_forward_s is not None and 0 < nd.warm_forward_s <= nd.forward_s
        assert 0 <= nd.warm_forward_fixed_s <= nd.warm_forward_s
        for scale in (0.5, 1.0, 4.0, 16.0):
            assert 0 <= nd.warm_at(scale) <= nd.times_at(scale)[0]
    node = prof.nodes[0].model_copy(update={"forward_s": 3.0, "forward_fixed_s": 1.0, "warm_forward_s": 2.0,
                                            "warm_forward_fixed_s": 0.5})
    assert node.warm_at(1.0) == 2.0 and node.warm_at(4.0) == 0.5 + 1.5 * 4
    assert prof.node_warm(16) == [nd.warm_at(2.0) for nd in prof.nodes]
    hand = Profile.synthetic([1e-3, 2e-3])
    assert hand.node_warm(1) == [t for t, _ in hand.node_times(1)]
    with pytest.raises(ValueError, match="warm forward"):
        Profile.model_validate({**hand.model_dump(), "nodes": [
            {**hand.nodes[0].model_dump(), "warm_forward_s": 2e-3}, hand.nodes[1].model_dump()]})


def test_a_model_with_a_fixed_batch_scales_linearly() -> None:
    class Fixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x.reshape(8, 16))  # only runs on 8 samples

    sample = torch.randn(8, 16)
    prof = profile_graph(build_graph(Fixed(), sample), sample, repeats=2, num_threads=1)
    assert all(nd.forward_fixed_s == 0 and nd.backward_fixed_s == 0 for nd in prof.nodes)


def test_the_linear_nodes_are_timed_as_their_backward_s_halves_too() -> None:
    """A node with a linear layer gets ``I`` and ``W`` (and their fixed parts); a ReLU keeps its plain
    backward for both; the profile leaves no gradients behind."""
    model = mlp()
    sample = torch.randn(8, 16)
    prof = profile_graph(build_graph(model, sample), sample, repeats=3, num_threads=1)
    assert [nd.split for nd in prof.nodes] == [True, False, True, True]
    for nd in prof.nodes:
        if nd.split:
            assert nd.input_backward_s > 0 and nd.weight_s > 0
            assert 0 <= nd.input_backward_fixed_s <= nd.input_backward_s
            assert 0 <= nd.weight_fixed_s <= nd.weight_s
    relu = prof.nodes[1]
    assert relu.halves_at(2.0) == (relu.times_at(2.0)[1], 0.0)
    node = prof.nodes[0].model_copy(update={"input_backward_s": 2.0, "input_backward_fixed_s": 0.5,
                                            "weight_s": 1.0, "weight_fixed_s": 0.25})
    assert node.halves_at(1.0) == (2.0, 1.0)
    assert node.halves_at(3.0) == (0.5 + 1.5 * 3, 0.25 + 0.75 * 3)
    assert all(p.grad is None for c in model for p in c.parameters())


def test_the_node_table_prices_every_node_as_the_node_does() -> None:
    """The planner prices all nodes at a size in one pass (NodeTable): the same floats, bit for bit, as each
    node's own times_at, warm_at and halves_at, split or not, with or without a warm forward or a flush's
    line, at sizes under, at and past the profiled ones."""
    rng = random.Random(14)
    nodes = []
    for k in range(300):
        f, b = rng.uniform(1e-5, 1e-2), rng.uniform(1e-5, 2e-2)
        i, w = (rng.uniform(0, b), rng.uniform(0, b)) if rng.random() < 0.6 else (0.0, 0.0)
        warm = rng.uniform(0, f) if rng.random() < 0.5 else None
        nodes.append(NodeProfile(
            name=f"n{k}", forward_s=f, backward_s=b, forward_fixed_s=rng.uniform(0, f),
            backward_fixed_s=rng.uniform(0, b),
            input_backward_s=i, weight_s=w, input_backward_fixed_s=rng.uniform(0, i),
            weight_fixed_s=rng.uniform(0, w), weight_flush_s=rng.choice([0.0, rng.uniform(0, 5 * w)]),
            weight_flush_scale=rng.choice([0.0, 2.0, float(SCALE_FACTOR), 16.0]), warm_forward_s=warm,
            warm_forward_fixed_s=0.0 if warm is None else rng.uniform(0, warm), param_bytes=0, grad_bytes=0,
            optimizer_state_bytes=0, activation_bytes=0))
    table = NodeTable(nodes)
    for scale in (0.25, 1.0, 3.0, float(SCALE_FACTOR), 5.0, 17.5, 64.0):
        forward, backward = table.times_at(scale)
        i, w = table.halves_at(scale)
        times = list(zip(forward.tolist(), backward.tolist(), strict=True))
        assert times == [nd.times_at(scale) for nd in nodes]
        assert table.warm_at(scale).tolist() == [nd.warm_at(scale) for nd in nodes]
        assert list(zip(i.tolist(), w.tolist(), strict=True)) == [nd.halves_at(scale) for nd in nodes]


def _logged(names: list[str], log: list[tuple[str, str]], shared: nn.Linear | None = None) -> list[Cell]:
    """Cells of Linear(16, 16) that log their forwards ("F") and their backwards ("B") as they run;
    ``shared``: the middle cell calls it too (a module two nodes call)."""
    class Logged(nn.Module):
        def __init__(self, name: str) -> None:
            super().__init__()
            self.name, self.lin = name, nn.Linear(16, 16)
            self.again = shared if name == names[len(names) // 2] else None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            log.append(("F", self.name))
            y = self.lin(x)
            if self.again is not None:
                y = self.again(y)
            if y.requires_grad:
                y.register_hook(lambda g: log.append(("B", self.name)) or g)  # type: ignore[func-returns-value]
            return y

    return [Cell(name, Logged(name)) for name in names]


def test_a_round_plays_its_nodes_as_a_stage_does() -> None:
    """[Note: a node's turn]: a round runs every node's forward, every forward again, every backward in
    reverse, then the split backward the same way (the deferred forwards, their ``I`` s in reverse): a
    node's backward never follows its own forward at once, as in a step of two or more nodes."""
    names = ["a", "b", "c"]
    log: list[tuple[str, str]] = []
    sample = torch.randn(4, 16)
    graph = build_graph(_logged(names, log), sample)
    log.clear()
    profile_graph(graph, sample, repeats=1, warmup=0, num_threads=1)
    start = log.index(("B", "c")) - 2 * len(names)  # the first round (the setup's forwards run no backward)
    fwd, bwd = [("F", n) for n in names], [("B", n) for n in reversed(names)]
    assert log[start:start + 5 * len(names)] == fwd + fwd + bwd + fwd + bwd


def test_a_round_holds_a_bounded_run_of_graphs() -> None:
    """A round's nodes hold their graphs until their backward: a model whose activations exceed
    ``WINDOW_BYTES`` plays in runs of consecutive nodes, each within it (at least one node)."""
    from coordinator.planning.profile import _windows

    nodes = list("abcdefg")
    runs = _windows(nodes, [WINDOW_BYTES // 3] * 4 + [WINDOW_BYTES * 2, 1, 1], WINDOW_BYTES)  # type: ignore[arg-type]
    assert runs == [list("abc"), ["d"], ["e"], list("fg")]
    assert _windows(nodes, [0] * 7, WINDOW_BYTES) == [nodes]  # type: ignore[arg-type]


def test_a_layer_two_nodes_call_is_deferred_by_one_at_a_time() -> None:
    """A module called by two nodes (here the middle cell calls the first's layer again): their stores
    would both patch it; the round splits their backwards apart, and the model is left as it was."""
    log: list[tuple[str, str]] = []
    shared = nn.Linear(16, 16)
    cells = [Cell("a", shared), *_logged(["b", "c", "d"], log, shared=shared)]
    sample = torch.randn(4, 16)
    prof = profile_graph(build_graph(cells, sample), sample, repeats=2, num_threads=1)
    assert [nd.split for nd in prof.nodes] == [True, True, True, True]
    assert "forward" not in shared.__dict__  # no store's patch left behind
    assert all(p.grad is None for c in cells for p in c.parameters())
    assert torch.equal(shared(sample), nn.functional.linear(sample, shared.weight, shared.bias))


@pytest.mark.parametrize("given", [4, 5])
def test_a_profile_at_another_size_is_the_one_taken_on_a_sample_of_that_size(given: int) -> None:
    """``size=12`` tiles the sample's rows (``given`` of them: 3 copies, or 3 copies cut) and records every
    byte as a profile taken on 12 samples does; ``scaled=False`` times that size alone."""
    model, rows = mlp(), torch.randn(12, 16)
    graph = build_graph(model, rows[:given])
    resized = profile_graph(graph, rows[:given], repeats=1, warmup=0, size=12, scaled=False)
    direct = profile_graph(build_graph(model, rows), rows, repeats=1, warmup=0, scaled=False)
    assert resized.microbatch_size == direct.microbatch_size == 12
    assert resized.cuts == direct.cuts and resized.cuts[1].tensors[0].shape == (12, 64)
    same = ("activation_bytes", "deferred_bytes", "param_bytes", "grad_bytes", "deferred_weight_bytes")
    for a, b in zip(resized.nodes, direct.nodes, strict=True):
        assert all(getattr(a, f) == getattr(b, f) for f in same)
        # one size timed: nothing is fixed, the flush is not timed, times scale linearly from it
        assert (a.forward_fixed_s, a.backward_fixed_s, a.weight_flush_s) == (0.0, 0.0, 0.0)
        assert a.forward_s > 0
    assert resized.node_times(24)[0][0] == pytest.approx(2 * resized.nodes[0].forward_s)
    # the graph's own sample: unchanged by the resize (the graph still records its 4 or 5 samples)
    assert graph.sample_batch == given


def test_a_size_is_refused_for_a_graph_without_a_batch_dimension() -> None:
    class Scalar(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(()))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.w

    sample = torch.tensor(2.0)
    with pytest.raises(ValueError, match="cannot profile 8 samples: no input of the graph has a known"):
        profile_graph(build_graph(Scalar(), sample), sample, repeats=1, warmup=0, size=8)
    rows = torch.randn(4, 16)
    with pytest.raises(ValueError, match="size must be >= 1 samples, got 0"):
        profile_graph(build_graph(mlp(), rows), rows, repeats=1, warmup=0, size=0)
