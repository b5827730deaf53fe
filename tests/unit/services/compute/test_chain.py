"""The chain every stage is built from: tracing, leaves, names, stage modules, 'values' boundaries."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from services.compute.boundary import BoundaryError, flatten, unflatten
from services.compute.cell import Cell
from services.compute.chain import UntraceableError, call_model, leaf_names, spread_arguments, trace_chain
from services.compute.stage import build_stage
from services.factories import FactoryAllowList
from services.protocol import Assignment, BoundarySpec, BoundaryTensor, ComputeOptions
from tests.multiproc.coordinator import plain_models as pm

PM = "tests.multiproc.coordinator.plain_models"
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[int], tuple[torch.Tensor, torch.Tensor]]]] = {
    "gpt": (pm.gpt, pm.tokens), "resnet": (pm.resnet, pm.images)}


def run_stages(chain: Any, bounds: tuple[int, ...], x: torch.Tensor) -> Any:
    value: Any = x
    for a, b in itertools.pairwise(bounds):
        value = chain.stage_module(a, b)(value)  # one value, or a tuple of the values crossing
    return value


@pytest.mark.parametrize("name", list(MODELS))
def test_stage_modules_in_sequence_are_the_model_bit_for_bit(name: str) -> None:
    factory, data = MODELS[name]
    torch.manual_seed(0)
    model = factory()
    x, _ = data(5)
    chain = trace_chain(model)
    n = len(chain)
    expected = model(x)
    expected.square().sum().backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    for bounds in [(0, n), (0, 1, n), (0, 3, 6, n), tuple(range(n + 1))]:
        model.zero_grad(set_to_none=True)
        out = run_stages(chain, bounds, x)
        assert torch.equal(out, expected), bounds
        out.square().sum().backward()
        assert all(torch.equal(p.grad, grads[k]) for k, p in model.named_parameters()), bounds  # type: ignore[arg-type]


def test_the_nodes_and_what_crosses_each_cut() -> None:
    chain = trace_chain(pm.resnet())
    assert [nd.name for nd in chain.nodes] == ["stem", "blocks.0", "shortcuts.0", "blocks.1", "shortcuts.1",
                                               "blocks.2", "shortcuts.2", "head", "stem_head"]
    crossing = [[nd.name for nd in chain.crossing(c)] for c in range(len(chain) + 1)]
    assert crossing[1] == ["relu"]  # the stem's output: the next block's input and the long skip at once
    assert crossing[2] == ["relu", "blocks_0"]  # the block's input (the shortcut's) beside the branch
    assert crossing[4] == ["relu", "relu_1", "blocks_1"]
    assert all(crossing[c][0] == "relu" for c in range(1, 8))  # the long skip crosses every cut...
    assert crossing[8] == ["head", "mean_1"]  # ...the last as its mean, taken in node 7 after the head
    assert [nd.name for nd in trace_chain(pm.gpt()).nodes] == ["tok", "blocks.0", "blocks.1", "blocks.2",
                                                                "blocks.3", "ln", "head"]


def test_names_are_the_models_state_dict_keys_and_every_tensor_is_held() -> None:
    model = pm.gpt()
    chain = trace_chain(model)
    named = dict(chain.named_tensors())
    persistent = model.state_dict()
    assert set(persistent) <= set(named)  # the non-persistent causal masks are held too, not saved
    assert all(named[k] is v for k, v in model.state_dict(keep_vars=True).items())
    assert chain.holders()["pos"] == (0,)  # a parameter of the root, used by a free op of node 0
    first, second = chain.stage_tensors(0, 3), chain.stage_tensors(3, 7)
    assert {n for n, _ in first} | {n for n, _ in second} == set(named)
    assert {n for n, _ in first} & {n for n, _ in second} == set()
    assert [n for n, _ in second][-3:] == ["head.weight", "blocks.2.causal", "blocks.3.causal"]


def test_a_tied_parameter_is_held_under_one_name_by_both_nodes() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(8, 4)
            self.mid = nn.Linear(4, 4)
            self.head = nn.Linear(4, 8, bias=False)
            self.head.weight = self.tok.weight

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return self.head(self.mid(self.tok(idx)))

    chain = trace_chain(Tied())
    assert chain.holders()["tok.weight"] == (0, 2) and "head.weight" not in chain.holders()
    assert [n for n, _ in chain.stage_tensors(2, 3)] == ["tok.weight"]  # the tied group: one name, two stages


def test_a_cell_sequence_is_one_node_per_cell_named_by_cells() -> None:
    made = [nn.Linear(3, 4), Cell("head", nn.Linear(4, 2))]
    chain = trace_chain(made)
    assert [nd.name for nd in chain.nodes] == ["cell0", "head"] and chain.cells is not None
    assert [n for n, _ in chain.named_tensors()] == ["cell0.weight", "cell0.bias", "head.weight", "head.bias"]
    x = torch.randn(2, 3)
    assert torch.equal(chain.stage_module(1, 2)(chain.stage_module(0, 1)(x)), nn.Sequential(*made)(x))
    assert [nd.name for nd in trace_chain(nn.Sequential(nn.Tanh(), nn.ReLU())).nodes] == ["cell0", "cell1"]


class Gate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if x.sum() > 0 else -x  # data-dependent control flow: torch.fx cannot trace it


class Body(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.gate = Gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(self.lin(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = Body()  # not in a container: traced into
        self.out = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.body(x))


def test_an_untraceable_submodule_is_named_with_why_and_the_fix() -> None:
    with pytest.raises(UntraceableError) as info:
        trace_chain(Net())
    assert str(info.value) == (
        "torch.fx cannot trace submodule 'body.gate' (Gate): TraceError: symbolically traced variables "
        "cannot be used as inputs to control flow; list it in model.leaves (model: {leaves: [body.gate]}, "
        "Job(leaves=['body.gate'])) to run it as one node, untraced, or give the model as a sequence of "
        "cellmesh.Cell")
    chain = trace_chain(Net(), ["body.gate"])
    assert [nd.name for nd in chain.nodes] == ["body.lin", "body.gate", "out"]
    x = torch.randn(4, 3)
    model = Net()
    assert torch.equal(run_stages(trace_chain(model, ["body.gate"]), (0, 2, 3), x), model(x))
    with pytest.raises(UntraceableError, match=r"own forward \(Gate\): TraceError: .* return \[model\]"):
        trace_chain(Gate())


def test_leaves_name_submodules_and_coarsen_the_chain() -> None:
    chain = trace_chain(Net(), ["body"])
    assert [nd.name for nd in chain.nodes] == ["body", "out"]
    with pytest.raises(ValueError, match=r"model.leaves names \['bdy'\], neither submodules of Net \(its "
                                         r"submodules: body, body.gate, body.lin, out\) nor classes of them "
                                         r"\(Body, Gate, Linear\)"):
        trace_chain(Net(), ["bdy"])
    with pytest.raises(ValueError, match="sequence of cells, which are never traced into"):
        trace_chain([nn.Linear(2, 2)], ["0"])


class Twice(nn.Module):
    """Two bodies outside any container, each with an untraceable gate: one class name makes both leaves."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = Body(), Body()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


def test_a_class_name_in_leaves_stands_for_every_submodule_of_the_class() -> None:
    assert leaf_names(Twice(), ["Gate"]) == ("first.gate", "second.gate")
    assert leaf_names(Twice(), ["Body", "Gate"]) == ("first", "second")  # a gate runs whole in its body
    assert leaf_names(Twice(), ["first", "Body"]) == ("first", "second")
    chain = trace_chain(Twice(), ["Gate"])
    assert [nd.name for nd in chain.nodes] == ["first.lin", "first.gate", "second.lin", "second.gate"]
    model = Twice()
    x = torch.randn(4, 3)
    assert torch.equal(run_stages(trace_chain(model, ["Gate"]), (0, 2, 4), x), model(x))


def values_spec(grad: bool = True) -> BoundarySpec:
    tensors = [BoundaryTensor(name=n, dtype="float64", shape=[4, 3], requires_grad=grad, batch_dim=0)
               for n in ("relu", "blocks_0")]
    return BoundarySpec(structure="values", tensors=tensors, batch_size=4)


def test_values_cross_as_a_tuple_in_graph_order() -> None:
    spec = values_spec()
    a, b = (torch.randn(2, 3, dtype=torch.float64, requires_grad=True) for _ in range(2))
    flat = flatten(spec, (a, b), 2, where="stage 0 microbatch 1 output")
    assert flat[0] is a and flat[1] is b
    back = unflatten(spec, flat)
    assert isinstance(back, tuple) and back[0] is a and back[1] is b
    with pytest.raises(BoundaryError, match=r"stage 0 microbatch 1 output: the plan says values of 2, got "
                                            r"float64\[2, 3\]"):
        flatten(spec, a, 2, where="stage 0 microbatch 1 output")
    with pytest.raises(BoundaryError, match="got tuple"):
        flatten(spec, (a, b, a), 2, where="here")


def test_a_stage_refuses_a_boundary_its_own_trace_does_not_cross() -> None:
    factories = FactoryAllowList.of([f"{PM}:resnet", f"{PM}:images", f"{PM}:cross_entropy"], "a test")

    def assign(spec: BoundarySpec) -> Any:
        options = ComputeOptions(stage=1, num_stages=2, registry="tcp://127.0.0.1:1", comm_prefix="/p",
                                 data=f"{PM}:images", loss=f"{PM}:cross_entropy", incoming=spec)
        return build_stage(Assignment(service="s", kind="compute", factory=f"{PM}:resnet", nodes=[2, 9]),
                           options, factories)

    stage = assign(values_spec())
    assert stage.nodes == ("shortcuts.0", "blocks.1", "shortcuts.1", "blocks.2", "shortcuts.2", "head",
                           "stem_head")
    assert [n for n, _ in stage.parameters()][:2] == ["blocks.1.conv1.weight", "blocks.1.norm1.weight"]
    wrong = values_spec().model_copy(update={"tensors": list(reversed(values_spec().tensors))})
    with pytest.raises(ValueError, match=r"the plan's incoming boundary \(values \['blocks_0', 'relu'\]\) is "
                                         r"not what crosses cut 2 of this worker's trace of the model "
                                         r"\(\['relu', 'blocks_0'\]\)"):
        assign(wrong)


def test_custom_autograd_functions_keep_their_own_backward() -> None:
    model = pm.quantized()
    chain = trace_chain(model)
    assert [nd.name for nd in chain.nodes] == ["first", "second", "out"]
    assert chain.nodes[0].ops == ("first", "tanh", "round_straight_through_apply")  # one operation
    x = torch.randn(8, pm.WIDTH, dtype=torch.float64)
    for bounds in [(0, 3), (0, 1, 3), (0, 1, 2, 3)]:
        traced = torch.autograd.grad(run_stages(chain, bounds, x).square().sum(), list(model.parameters()))
        eager = torch.autograd.grad(model(x).square().sum(), list(model.parameters()))
        assert all(torch.equal(a, b) for a, b in zip(traced, eager, strict=True)), bounds
    assert torch.autograd.Function.apply.__func__ is torch.autograd.Function.__dict__["apply"].__func__


class CallsBack(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return fn(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        return None, grad


class Wrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return CallsBack.apply(torch.tanh, self.lin(x))


def test_a_custom_function_given_a_python_callable_names_its_submodule_and_the_fix() -> None:
    class Root(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(3, 3)
            self.wrap = Wrapper()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.wrap(self.inner(x))

    with pytest.raises(UntraceableError) as info:
        trace_chain(Root())
    text = str(info.value)
    assert text.startswith("torch.fx cannot trace submodule 'wrap' (Wrapper): TypeError: custom autograd "
                           "function CallsBack is given an argument a traced graph cannot hold")
    assert "list it in model.leaves" in text
    assert torch.autograd.Function.apply.__func__ is torch.autograd.Function.__dict__["apply"].__func__
    root = Root()
    x = torch.randn(2, 3)
    assert torch.equal(run_stages(trace_chain(root, ["wrap"]), (0, 2), x), root(x))  # the fix


class Recomputed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.lin, x, use_reentrant=True)


class WithRecompute(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(3, 3).double()
        self.body = Recomputed()  # traced into: not a leaf
        self.out = nn.Linear(3, 1).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.body(self.first(x)))


def test_torchs_own_functions_are_traced_into_as_fx_does() -> None:
    # torch.utils.checkpoint's reentrant CheckpointFunction takes a module and recomputes the forward:
    # its gradient is the forward's, so the chain runs the forward's operations, one node for the Linear
    model = WithRecompute()
    chain = trace_chain(model)
    assert [nd.name for nd in chain.nodes] == ["first", "body.lin", "out"]
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    traced = torch.autograd.grad(run_stages(chain, (0, 2, 3), x).sum(), list(model.parameters()))
    model(x).sum().backward()  # eager: the reentrant checkpoint takes no autograd.grad
    assert all(torch.equal(t, p.grad) for t, p in zip(traced, model.parameters(), strict=True))


@pytest.mark.parametrize("as_dict", [False, True], ids=["tuple", "dict"])
def test_a_forward_of_several_arguments_takes_the_inputs_as_one_value(as_dict: bool) -> None:
    model = pm.masked()
    (x, mask), _ = pm.masked_vectors(num_samples=4)
    inputs: Any = {"mask": mask, "x": x} if as_dict else (x, mask)
    chain = trace_chain(model)
    assert [str(nd.target) for nd in chain.module.graph.nodes if nd.op == "placeholder"] == ["inputs"]
    assert [nd.name for nd in chain.crossing(1)] == ["argument_1", "tanh"]  # the mask crosses to its user
    expected = model(x, mask)  # scale takes its default
    assert torch.equal(call_model(model, inputs), expected)
    assert torch.equal(run_stages(chain, (0, 1, 3), inputs), expected)


@pytest.mark.parametrize(("inputs", "message"), [
    (lambda x, m: (x,), r"takes 2 required arguments \(x, mask\), .* they are a tuple of 1"),
    (lambda x, m: (x, m, 3.0), r"they are a tuple of 3"),
    (lambda x, m: {"x": x}, r"they are a dict with keys \['x'\]"),
    (lambda x, m: {"x": x, "mask": m, "scale": 3.0}, r"give 'scale', an argument of the model's forward with "
                                                       r"a default, .* or make 'scale' required"),
    (lambda x, m: x, r"they are one Tensor"),
])
def test_inputs_that_do_not_fit_a_forward_of_several_arguments_are_named(
        inputs: Callable[[torch.Tensor, torch.Tensor], Any], message: str) -> None:
    model = pm.masked()
    (x, mask), _ = pm.masked_vectors(num_samples=4)
    with pytest.raises(TypeError, match=message):
        trace_chain(model).module(inputs(x, mask))
    with pytest.raises(TypeError, match=message):
        call_model(model, inputs(x, mask))


def test_a_forward_with_one_required_argument_is_called_with_the_inputs_whole() -> None:
    model = nn.Linear(3, 2)
    x = torch.randn(4, 3)
    assert spread_arguments(model) is None and torch.equal(call_model(model, x), model(x))
    assert spread_arguments(pm.masked()) == (("x", "mask"), ("scale",))


class KeywordOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3).double()

    def forward(self, x: torch.Tensor, mask: torch.Tensor, *, scale: float = 3.0) -> torch.Tensor:
        return self.lin(x) * mask * scale


def test_a_keyword_only_argument_keeps_its_default() -> None:
    model = KeywordOnly()
    x, mask = torch.randn(4, 3, dtype=torch.float64), torch.ones(4, 3, dtype=torch.float64)
    assert torch.equal(trace_chain(model).module((x, mask)), model(x, mask))
