"""Graph capture: chains from cells and from fx, exact crossing tensors at every cut, stage modules."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from torch import nn

from coordinator.planning.graph import Graph, build_graph
from services.compute.cell import Cell
from services.compute.chain import UntraceableError


class SkipNet(nn.Module):
    """Five nodes; ``h`` skips nodes 1-3 and the input ``x`` skips everything up to node 3."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.b1 = nn.Linear(8, 8)
        self.b2 = nn.Linear(8, 6)
        self.b3 = nn.Linear(6, 8)
        self.head = nn.Linear(12, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)                    # node 0
        y = torch.relu(self.b1(h))           # node 1 (relu joins b1)
        y = self.b2(y)                       # node 2
        y = self.b3(y) + h                   # node 3 (add and cat join b3)
        return self.head(torch.cat([y, x], dim=1))  # node 4


def crossing(graph: Graph) -> list[list[tuple[str, tuple[int, ...], bool]]]:
    return [[(t.name, t.shape, t.requires_grad) for t in cut.tensors] for cut in graph.cuts]


def test_crossing_tensors_of_a_skip_connection_across_several_cuts() -> None:
    graph = build_graph(SkipNet(), torch.randn(3, 4))
    assert [n.name for n in graph.nodes] == ["embed", "b1", "b2", "b3", "head"]
    assert [n.ops for n in graph.nodes] == [("embed",), ("b1", "relu"), ("b2",), ("b3", "add", "cat"),
                                            ("head",)]
    x, h = ("x", (3, 4), False), ("embed", (3, 8), True)
    assert crossing(graph) == [
        [x],                                  # cut 0: the model input
        [x, h],                               # cut 1: h and x are both still needed later
        [x, h, ("relu", (3, 8), True)],       # cut 2
        [x, h, ("b2", (3, 6), True)],         # cut 3: last cut h and x cross
        [("cat", (3, 12), True)],             # cut 4
        [("head", (3, 2), True)],             # cut 5: the model output
    ]
    assert graph.cuts[2].forward_bytes == (12 + 24 + 24) * 4
    assert graph.cuts[2].backward_bytes == (24 + 24) * 4  # x needs no gradient
    assert all(c.cuttable for c in graph.cuts)
    assert all(t.batch_dim == 0 for c in graph.cuts for t in c.tensors)


@pytest.mark.parametrize("bounds", [(0, 5), (0, 1, 5), (0, 2, 4, 5), (0, 1, 2, 3, 4, 5), (0, 3, 5)])
def test_stage_modules_compose_to_the_model_forward_and_backward(bounds: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    model = SkipNet()
    x = torch.randn(5, 4)
    model(x).square().sum().backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    graph = build_graph(model, torch.randn(3, 4))
    value: Any = x
    for a, b in itertools.pairwise(bounds):
        value = graph.stage_module(a, b)(value)  # one value, or a tuple of the values crossing
    assert torch.allclose(value, model(x))
    value.square().sum().backward()
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, expected[name]), name  # type: ignore[arg-type]


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lin(x), torch.tanh(x)


class Merge(nn.Module):
    def forward(self, t: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return t[0] * t[1]


def cells() -> list[Cell]:
    return [Cell("in", nn.Linear(4, 8)), Cell("pair", Pair()), Cell("merge", Merge()),
            Cell("out", nn.Linear(8, 1))]


def test_cell_sequence_with_a_tuple_between_cells() -> None:
    model = cells()
    graph = build_graph(model, torch.randn(5, 4))
    assert [n.name for n in graph.nodes] == ["in", "pair", "merge", "out"]
    assert [t.name for t in graph.cuts[2].tensors] == ["pair.0", "pair.1"]  # a tuple travels flattened
    assert graph.flat_names(2) == ("pair.0", "pair.1")
    x = torch.randn(5, 4)
    first, second = graph.stage_module(0, 2), graph.stage_module(2, 4)
    reference = nn.Sequential(*model)(x)
    assert torch.allclose(second(first(x)), reference)  # the tuple passes whole, as between cells


def test_a_dict_between_cells_crosses_as_its_tensors() -> None:
    class Split(nn.Module):
        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"h": x * 2, "pos": torch.arange(x.shape[0]).unsqueeze(1).expand(-1, x.shape[1])}

    class Join(nn.Module):
        def forward(self, d: dict[str, torch.Tensor]) -> torch.Tensor:
            return d["h"] + d["pos"]

    model = [Cell("lin", nn.Linear(3, 3)), Cell("split", Split()), Cell("join", Join())]
    graph = build_graph(model, torch.randn(4, 3))
    cut = graph.cuts[2]
    assert cut.structure == "dict"
    assert [(t.name, t.dtype, t.requires_grad, t.batch_dim) for t in cut.tensors] == [
        ("split.h", "float32", True, 0), ("split.pos", "int64", False, 0)]
    assert graph.cuts[1].structure == "tensor"
    x = torch.randn(4, 3)
    assert torch.equal(graph.stage_module(2, 3)(graph.stage_module(0, 2)(x)), nn.Sequential(*model)(x))
    skips = build_graph(SkipNet(), torch.randn(3, 4))
    assert [c.structure for c in skips.cuts] == ["tensor", "values", "values", "values", "tensor", "tensor"]


def test_cells_are_not_traced_into() -> None:
    class Untraceable(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2 if x.sum() > 0 else x  # data-dependent: fx cannot trace it

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.gate = Untraceable()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.gate(self.lin(x))

    graph = build_graph([Cell("a", nn.Linear(3, 3)), Cell("b", Untraceable())], torch.randn(2, 3))
    assert len(graph) == 2
    with pytest.raises(UntraceableError, match=r"submodule 'gate' \(Untraceable\): .* in model.leaves"):
        build_graph(Net(), torch.randn(2, 3))
    assert [nd.name for nd in build_graph(Net(), torch.randn(2, 3), leaves=["gate"]).nodes] == ["lin", "gate"]


def test_duplicate_cell_names_are_refused() -> None:
    with pytest.raises(ValueError, match="unique"):
        build_graph([Cell("a", nn.Linear(2, 2)), Cell("a", nn.Linear(2, 2))], torch.randn(1, 2))
    with pytest.raises(ValueError, match="whitespace"):
        Cell("a b", nn.Identity())


def test_module_list_children_are_nodes() -> None:
    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(4, 8)
            self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3))
            self.out = nn.Linear(8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.inp(x)
            for layer in self.layers:
                x = x + layer(x)
            return self.out(x)

    graph = build_graph(Stack(), torch.randn(2, 4))
    assert [n.name for n in graph.nodes] == ["inp", "layers.0", "layers.1", "layers.2", "out"]


def test_a_non_tensor_crossing_makes_the_cut_uncuttable() -> None:
    class Reshape(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 8)
            self.b = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            n = x.size(0)  # an int computed in node 0, used in node 1
            return self.b(self.a(x)).view(n, 2, 4)

    graph = build_graph(Reshape(), torch.randn(3, 4))
    assert not graph.cuts[1].cuttable
    assert "size is a int" in (graph.cuts[1].uncuttable_reason or "")
    assert graph.flat_names(1) == ("size", "a")
    assert "uncuttable" in str(graph)


def test_shapes_scale_with_the_microbatch() -> None:
    graph = build_graph(SkipNet(), torch.randn(3, 4))
    meta = graph.cuts[3].tensors[2]
    assert (meta.name, meta.shape, meta.nbytes, meta.batch_dim) == ("b2", (3, 6), 72, 0)
    bigger = meta.at_batch(8, 3)
    assert (bigger.shape, bigger.nbytes) == ((8, 6), 8 * 6 * 4)


def test_a_parameter_shared_across_nodes_is_held_by_both() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)
            self.scale = nn.Parameter(torch.ones(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x) * self.scale) * self.scale

    model = Tied()
    graph = build_graph(model, torch.randn(2, 4))
    assert graph.chain.holders()["scale"] == (0, 1)
    assert [n for n, _ in graph.chain.stage_tensors(1, 2)] == ["scale", "b.weight", "b.bias"]  # model order
    x = torch.randn(3, 4)
    assert torch.equal(graph.stage_module(1, 2)(graph.stage_module(0, 1)(x)), model(x))


def test_a_model_that_fails_on_the_sample_names_the_node_and_its_inputs() -> None:
    cells = [Cell("embed", nn.Linear(4, 8)), Cell("head", nn.Linear(6, 2))]
    with pytest.raises(ValueError) as info:
        build_graph(cells, torch.randn(3, 4))
    assert str(info.value) == ("node 'head' (head) fails on [3, 8] float32: RuntimeError: mat1 and mat2 "
                               "shapes cannot be multiplied (3x8 and 6x2)")  # without torch.fx's notes
