"""A model as a chain of cuttable nodes, and the module that runs any range of them -- without a sample.

Both the coordinator (planning, ``coordinator/planning/graph.py``) and every worker (its stage,
``services/compute/stage.py``) call :func:`trace_chain` on the model its factory built (seeded, so
the same model): tracing is deterministic, so both see the same nodes, the same values crossing
every cut and the same names, and a worker runs nodes ``[start, stop)`` of the plan exactly as the
coordinator planned them. Nothing here runs the model: shapes are the graph's business.

Why torch.fx symbolic tracing, not ``torch.export``: fx keeps the module hierarchy, so a node is a
module of the user's model and its parameters keep their names (the model's own ``state_dict``
keys, so checkpoints and ``Job.fit``'s result load into the model with ``strict=True``) and are
shared with it, not copied; it needs no example inputs and runs in milliseconds. ``torch.export``
specialises shapes to an example (microbatches differ in size), lifts parameters out of the
modules, and is cut only where ``pipe_split()`` marks were written into the model.

What becomes a node (the leaf rule). Tracing runs the model's ``forward`` on proxies and stops at
*leaf* modules, which it records as calls without looking inside:

- a :class:`~services.compute.cell.Cell`, and every module named in ``leaves`` (qualified names or
  class names, the config's ``model.leaves``: how an untraceable submodule is run whole);
- a child of a container (``nn.Sequential``/``ModuleList``/``ModuleDict``): a block of a stack,
  whatever it is (an ``nn.Sequential`` block too);
- a ``torch.nn`` module (``nn.Linear``, ``nn.LayerNorm``...: torch.fx's own rule).

Containers and the model's other submodules are traced into. Each leaf call starts a node; the
free operations after it (a residual ``+``, a ``flatten``) join it (those before any leaf join the
first node). A model with no leaf at all is one node, ``"ops"``. A model given as a sequence of
cells (a list of modules, an ``nn.Sequential``, an ``nn.ModuleList``: :func:`is_cell_sequence`)
is traced as ``nn.Sequential`` of its cells: one node per cell, named after the cell.

[Note: custom autograd functions] torch.fx traces *through* ``MyFunction.apply(x)``: it runs the
function's ``forward`` on proxies and records its operations, so the graph computes the same
values but autograd differentiates those operations, not ``MyFunction.backward`` (a
straight-through estimator, a gradient reversal, a hand-written fused backward would all train
with another gradient, silently). While :func:`trace_chain` traces, ``torch.autograd.Function.apply``
records a call of the function on proxies as one graph operation (``call_function`` of a small
caller of ``MyFunction.apply``), so the stage runs the function itself, backward included. Its
arguments must be what a graph holds (tensors, numbers, strings, tuples, lists, dicts of them);
a function given another object (a Python callable, say) cannot be kept: the submodule
calling it is named with the fix (``model.leaves``). torch's own functions are traced into as
fx does: their backward is their forward's gradient (``torch.utils.checkpoint``'s reentrant
``CheckpointFunction`` recomputes the forward, and would take a module as an argument).

[Note: a forward of several arguments] The data gives a model its inputs as one value (``model(inputs)``:
a tensor, or a tuple, list or dict of tensors). A model whose ``forward`` takes two or more required
arguments (``forward(self, x, mask)``) gets them spread from that value instead, as a torch training
loop writes ``model(*inputs)`` or ``model(**inputs)``: a tuple or list of one value per required
argument, in order, or a dict by their names. Its arguments with defaults take their defaults (a
constant in the graph, as fx's ``concrete_args`` makes them); inputs that give one are refused by name
rather than dropped. The traced graph takes the one value and picks each argument from it (an
``argument`` operation each, joining the first node), so a stage, the profile and the preflight call
every model alike, and :func:`call_model` calls the model itself (the one-process reference) by the
same rule. A ``forward`` with one required argument is called ``model(inputs)`` as before.

[Note: liveness] A value produced by node ``p`` (``p = -1`` for a model input) and last used by
node ``u`` (``u = n`` when the model returns it) is alive across every cut ``c`` with
``p < c <= u`` (cut ``c`` lies between node ``c-1`` and node ``c``). All of them cross a stage
boundary placed at ``c``: a skip connection from node 1 to node 4 crosses cuts 2, 3 and 4 and is
relayed by every stage in between (sending it straight from the stage that makes it to the stage
that uses it is a later step).

Stage modules (:meth:`Chain.stage_module`) take and return what crosses their cuts as cells do:
one value when one value crosses (a tensor, or a tuple, list or dict of tensors), a tuple of the
values in graph order when several cross. The first stage takes the model's inputs as the model
does; the last returns the model's output.

Names. A tensor is named as the model names it: its first key in ``model.state_dict()`` (a
parameter tied under two keys has its first), or ``"{cell}.{name in the cell}"`` in a cell
sequence. A tensor belongs to every node that uses it (:meth:`Chain.holders`): a parameter used
by nodes of two stages is held by both stages, under one name, which is how tied parameters are
found. A tensor no node uses belongs to node 0, so a stage holds every tensor of the model.
"""

from __future__ import annotations

import functools
import inspect
import keyword
import operator
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.autograd.function import Function
from torch.utils import _pytree

from services.compute.cell import Cell, as_cells, cell_parameters

__all__ = ["Chain", "ChainNode", "UntraceableError", "argument", "call_model", "is_cell_sequence",
           "leaf_names", "spread_arguments", "trace_chain"]

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


class UntraceableError(ValueError):
    """torch.fx cannot trace the model: the message names the submodule, why, and how to proceed."""


@dataclass(frozen=True)
class ChainNode:
    """A cuttable node: one leaf module call plus the free operations after it."""

    index: int
    name: str  # the leaf's qualified name in the model (a cell's name), "ops" for a model without leaves
    ops: tuple[str, ...]  # its fx node names, in graph order


def is_cell_sequence(made: Any) -> bool:
    """Whether a model factory's result is a sequence of cells rather than a module to trace.

    A list or tuple of modules, an ``nn.Sequential``, an ``nn.ModuleList`` and a lone ``Cell`` are
    (see :func:`~services.compute.cell.as_cells`); any other ``nn.Module`` is traced.
    """
    return not isinstance(made, nn.Module) or isinstance(made, Cell | nn.Sequential | nn.ModuleList)


_APPLY = Function.__dict__["apply"]  # torch's classmethod, restored after each trace
_TRACING = threading.Lock()  # one trace at a time patches Function.apply


def _caller(cls: type[Function]) -> Callable[..., Any]:
    """A plain function calling ``cls.apply`` as torch defines it: the target of its graph operation
    (fx writes a call of it into the stage's code)."""
    def call(*args: Any, **kwargs: Any) -> Any:
        return _APPLY.__func__(cls, *args, **kwargs)

    call.__name__ = call.__qualname__ = f"{cls.__name__}_apply"
    call.__module__ = cls.__module__
    return call


class _ChainTracer(fx.Tracer):
    """torch.fx's tracer with the leaf rule of the module docstring; remembers where tracing failed."""

    def __init__(self, root: nn.Module, leaves: frozenset[str]) -> None:
        super().__init__()
        self._root = root
        self._leaves = leaves
        self.failed_in: str | None = None  # the innermost module being traced when tracing failed

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self._leaves or isinstance(m, Cell):
            return True
        parent = module_qualified_name.rpartition(".")[0]
        if isinstance(self._root.get_submodule(parent), _CONTAINERS):
            return True  # a block of a stack, whatever it is (an nn.Sequential too)
        if isinstance(m, _CONTAINERS):
            return False
        return bool(super().is_leaf_module(m, module_qualified_name))

    def trace(self, root: nn.Module | Callable[..., Any],
              concrete_args: dict[str, Any] | None = None) -> fx.Graph:
        """fx's trace, with custom autograd functions kept as one operation each ([Note: custom
        autograd functions])."""
        tracer = self

        def apply(cls: type[Function], *args: Any, **kwargs: Any) -> Any:
            if cls.__module__.startswith("torch.") or not any(
                    isinstance(leaf, fx.Proxy) for leaf in _pytree.tree_leaves((args, kwargs))):
                return _APPLY.__func__(cls, *args, **kwargs)  # torch's own: traced into, as fx does
            try:
                return tracer.create_proxy("call_function", _caller(cls), args, kwargs)
            except NotImplementedError as exc:  # fx's create_arg: an argument a graph cannot hold
                raise TypeError(f"custom autograd function {cls.__qualname__} is given an argument a traced "
                                f"graph cannot hold ({_first_line(exc)}), so it cannot be kept with its "
                                "own backward") from exc

        with _TRACING:
            Function.apply = classmethod(apply)  # type: ignore[method-assign,assignment]
            try:
                return super().trace(root, concrete_args)
            finally:
                Function.apply = _APPLY  # type: ignore[method-assign]

    def call_module(self, m: nn.Module, forward: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_in is None:
                names = [name for name, sub in self._root.named_modules() if sub is m]
                self.failed_in = names[0] if names else None  # None: a module made in forward
            raise


def _first_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split("\n\n", 1)[0].split())
    return text or type(exc).__name__


def _untraceable(root: nn.Module, failed_in: str | None, exc: Exception) -> str:
    why = f"{type(exc).__name__}: {_first_line(exc)}"
    if not failed_in:
        return (f"torch.fx cannot trace the model's own forward ({type(root).__name__}): {why}; make it "
                "traceable (no Python control flow on tensor values), or return [model] from the factory to "
                "train it whole (one cell: data parallel only), or split it into cellmesh.Cell (cells are "
                "never traced into)")
    kind = type(root.get_submodule(failed_in)).__name__
    return (f"torch.fx cannot trace submodule {failed_in!r} ({kind}): {why}; list it in model.leaves "
            f"(model: {{leaves: [{failed_in}]}}, Job(leaves=[{failed_in!r}])) to run it as one node, "
            "untraced, or give the model as a sequence of cellmesh.Cell")


def spread_arguments(model: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """The names of ``model.forward``'s required arguments and of its optional ones when it takes two or
    more required ones (the data's inputs are spread over them: [Note: a forward of several arguments]);
    None when it takes one. A cell sequence takes one."""
    if is_cell_sequence(model):
        return None
    params = list(inspect.signature(model.forward).parameters.values())
    plain = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = tuple(p.name for p in plain if p.default is p.empty)
    if len(required) < 2:
        return None
    return required, tuple(p.name for p in plain if p.default is not p.empty)


def argument(inputs: Any, index: int, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> Any:
    """Required argument ``index`` of a forward of several arguments (``required`` names them; ``optional``
    the ones with defaults) from the data's ``inputs``: by position from a tuple or list of exactly one
    value per required argument, by name from a dict of them.

    Raises:
        TypeError: The inputs are neither, or give another number of values, or miss a name, or give an
            argument that has a default (it would be dropped: the forward takes its default).
    """
    given = (f"a dict with keys {sorted(map(str, inputs))}" if isinstance(inputs, Mapping)
             else f"a {type(inputs).__name__} of {len(inputs)}" if isinstance(inputs, tuple | list)
             else f"one {type(inputs).__name__}")
    names = ", ".join(required)
    if isinstance(inputs, Mapping):
        extra = [k for k in inputs if k not in required]
        if all(k in inputs for k in required) and not extra:
            return inputs[required[index]]
        if any(k in optional for k in extra):
            wrong = next(k for k in extra if k in optional)
            raise TypeError(f"the data's inputs ({given}) give {wrong!r}, an argument of the model's forward "
                            "with a default, which takes its default in every stage: give the required "
                            f"arguments ({names}) only, or make {wrong!r} required")
    elif isinstance(inputs, tuple | list) and len(inputs) == len(required):
        return inputs[index]
    raise TypeError(f"the model's forward takes {len(required)} required arguments ({names}), so the data's "
                    "inputs must give one value for each, as a tuple in that order or a dict by those names; "
                    f"they are {given}")


def call_model(model: nn.Module, inputs: Any) -> Any:
    """``model`` on the data's ``inputs`` as a stage calls it: spread over a forward of several arguments
    ([Note: a forward of several arguments]), else ``model(inputs)``."""
    spread = spread_arguments(model)
    if spread is None:
        return model(inputs)
    required, optional = spread
    return model(*(argument(inputs, i, required, optional) for i in range(len(required))))


def _take_one_value(graph: fx.Graph, spread: tuple[tuple[str, ...], tuple[str, ...]]) -> None:
    """Rewrites ``graph``'s placeholders of the required arguments into one placeholder, ``inputs``, and an
    ``argument`` operation each; the optional ones' uses take their defaults (fx keeps them in the
    placeholder's ``args``)."""
    required, optional = spread
    old = [nd for nd in graph.nodes if nd.op == "placeholder"]
    with graph.inserting_before(old[0]):
        inputs = graph.placeholder("inputs")
    after = old[-1]
    for node in old:
        name = str(node.target)
        if name in required:
            with graph.inserting_after(after):
                after = graph.call_function(argument, (inputs, required.index(name), required, optional))
            node.replace_all_uses_with(after)
        else:
            if not node.args:  # a keyword-only or variadic argument without a default
                raise UntraceableError(f"the model's forward takes {name!r} with no default, which the "
                                       "data's inputs cannot give (only its positional arguments are spread "
                                       f"from them); give {name!r} a default or make it positional")
            default = node.args[0]
            for user in list(node.users):
                user.replace_input_with(node, default)
    for node in old:
        graph.erase_node(node)


def _root_of(cells: Sequence[Cell]) -> nn.Sequential:
    """``nn.Sequential`` of ``cells``, each under its name where Python allows (fx writes source code)."""
    keys = [c.name if c.name.isidentifier() and not keyword.iskeyword(c.name)
            and not hasattr(nn.Sequential(), c.name) else f"cell{i}" for i, c in enumerate(cells)]
    return nn.Sequential(OrderedDict(zip(keys, cells, strict=True)))


def leaf_names(root: nn.Module, leaves: Iterable[str]) -> tuple[str, ...]:
    """The qualified names ``leaves`` stand for: each a submodule's qualified name, or a class name that
    stands for every submodule of that class (``Router``: each block's router); a name inside another
    leaf is dropped (it runs whole with it).

    Raises:
        ValueError: An entry names neither a submodule nor the class of one (listing some of them).
    """
    named = [(name, m) for name, m in root.named_modules() if name]
    names = {name for name, _ in named}
    out: list[str] = []
    unknown: list[str] = []
    for entry in leaves:
        if entry in names:
            out.append(entry)
            continue
        matches = [name for name, m in named if type(m).__name__ == entry]
        outer = [n for n in matches if not any(n.startswith(f"{o}.") for o in matches)]
        if outer:
            out.extend(outer)
        else:
            unknown.append(entry)
    if unknown:
        listed = ", ".join(sorted(names)[:12]) + (", ..." if len(names) > 12 else "")
        classes = ", ".join(sorted({type(m).__name__ for _, m in named})[:12])
        raise ValueError(f"model.leaves names {unknown}, neither submodules of {type(root).__name__} (its "
                         f"submodules: {listed}) nor classes of them ({classes})")
    return tuple(n for n in dict.fromkeys(out) if not any(n.startswith(f"{o}.") for o in out))


def trace_chain(model: nn.Module | Sequence[nn.Module], leaves: Iterable[str] = ()) -> Chain:
    """Traces ``model`` (what a model factory returned) into its chain of nodes.

    Args:
        model: A sequence of cells (see :func:`is_cell_sequence`) or any ``nn.Module``.
        leaves: Submodules to keep as one node each (``model.leaves``): qualified names, or class
            names standing for every submodule of the class (:func:`leaf_names`).

    Raises:
        UntraceableError: torch.fx cannot trace the model (the message names the submodule, the
            reason and the fix).
        ValueError: Cell names repeat, a leaf names no submodule, or leaves are given for cells.
    """
    wanted = tuple(leaves)
    cells: list[Cell] | None = None
    if is_cell_sequence(model):
        if wanted:
            raise ValueError(f"model.leaves {list(wanted)} is for a model torch.fx traces; this model is a "
                             "sequence of cells, which are never traced into: drop model.leaves")
        cells = as_cells(model)
        root: nn.Module = _root_of(cells)
    else:
        assert isinstance(model, nn.Module)
        root = model
        wanted = leaf_names(root, wanted)
    tracer = _ChainTracer(root, frozenset(wanted))
    try:
        graph = tracer.trace(root)
    except Exception as exc:
        raise UntraceableError(_untraceable(root, tracer.failed_in, exc)) from exc
    spread = None if cells is not None else spread_arguments(root)
    if spread is not None:
        _take_one_value(graph, spread)
    return Chain(fx.GraphModule(root, graph), root, cells)


def _attr(module: nn.Module, target: str) -> Any:
    return functools.reduce(getattr, target.split("."), module)


def _tensors_of(value: Any) -> list[torch.Tensor]:
    """The parameters and buffers a ``get_attr`` or ``call_module`` target holds."""
    if isinstance(value, nn.Module):
        return [*value.parameters(), *value.buffers()]
    return [value] if isinstance(value, torch.Tensor) else []


class Chain:
    """A traced model as ``n`` nodes, the values alive across each of its ``n + 1`` cuts, and its tensors.

    Attributes:
        module: The traced ``fx.GraphModule`` (it shares parameters and buffers with the model).
        nodes: The nodes, in order.
        cells: The model's cells when it is a cell sequence, else None.
    """

    def __init__(self, module: fx.GraphModule, root: nn.Module, cells: list[Cell] | None) -> None:
        self.module = module
        self.cells = cells
        group, names = self._group(module)
        self._group_of = group
        n = len(names)
        ops: list[list[str]] = [[] for _ in range(n)]
        for node, g in group.items():
            ops[g].append(node.name)
        self.nodes = tuple(ChainNode(i, names[i], tuple(ops[i])) for i in range(n))
        # get_attr nodes belong to every node that uses them (a stage copies those it needs)
        self._attr_users = {node: {group[u] for u in node.users} for node in module.graph.nodes
                            if node.op == "get_attr"}
        self._crossing: list[list[fx.Node]] = [[] for _ in range(n + 1)]
        for node in module.graph.nodes:
            if node.op in ("output", "get_attr") or not node.users:
                continue
            born = -1 if node.op == "placeholder" else group[node]
            last = max(n if u.op == "output" else group[u] for u in node.users)
            for c in range(born + 1, last + 1):
                self._crossing[c].append(node)
        self._named = self._name_tensors(root, cells)
        self._holders = self._find_holders()

    @staticmethod
    def _group(gm: fx.GraphModule) -> tuple[dict[fx.Node, int], list[str]]:
        """Each computing fx node's chain node, and the chain nodes' names."""
        group: dict[fx.Node, int] = {}
        names: list[str] = []
        pending: list[fx.Node] = []
        for node in gm.graph.nodes:
            if node.op in ("placeholder", "output", "get_attr"):
                continue
            if node.op == "call_module":
                sub = gm.get_submodule(str(node.target))
                names.append(sub.name if isinstance(sub, Cell) else str(node.target))
                for p in [*pending, node]:
                    group[p] = len(names) - 1
                pending = []
            elif names:
                group[node] = len(names) - 1
            else:
                pending.append(node)
        if not names:  # no leaf module at all: the whole model is one node
            names.append("ops")
            for p in pending:
                group[p] = 0
        return group, names

    @staticmethod
    def _name_tensors(root: nn.Module, cells: list[Cell] | None) -> dict[int, tuple[str, torch.Tensor]]:
        """Every parameter, then every buffer, of the model by ``id``, in the model's order: name and tensor.

        The traced module is not asked: it holds only what the forward uses, in graph order.
        """
        named: dict[int, tuple[str, torch.Tensor]] = {}
        if cells is not None:
            params: list[tuple[str, torch.Tensor]] = list(cell_parameters(cells))
            buffers = [(f"{c.name}.{n}", b) for c in cells for n, b in c.module.named_buffers()]
        else:
            params, buffers = list(root.named_parameters()), list(root.named_buffers())
        for name, tensor in [*params, *buffers]:
            named.setdefault(id(tensor), (name, tensor))
        return named

    def _find_holders(self) -> dict[int, set[int]]:
        """Each tensor's nodes (by ``id``): the nodes whose leaf module or attributes use it; else node 0."""
        holders: dict[int, set[int]] = {key: set() for key in self._named}
        for node in self.module.graph.nodes:
            if node.op == "call_module":
                users = {self._group_of[node]}
            elif node.op == "get_attr":
                users = self._attr_users[node]
            else:
                continue
            for t in _tensors_of(_attr(self.module, str(node.target))):
                if id(t) in holders:
                    holders[id(t)] |= users
        for nodes in holders.values():
            if not nodes:
                nodes.add(0)
        return holders

    def __len__(self) -> int:
        return len(self.nodes)

    def group_of(self, node: fx.Node) -> int | None:
        """The chain node an fx node computes in (None for inputs, attributes and the output)."""
        return self._group_of.get(node)

    def crossing(self, cut: int) -> tuple[fx.Node, ...]:
        """The values alive across cut ``cut`` (see [Note: liveness]), in graph order."""
        return tuple(self._crossing[cut])

    def leaf(self, index: int) -> nn.Module | None:
        """Node ``index``'s leaf module (a cell's wrapped module), None for a model without leaves."""
        target = next((nd.target for nd in self.module.graph.nodes
                       if nd.op == "call_module" and self._group_of[nd] == index), None)
        if target is None:
            return None
        sub = self.module.get_submodule(str(target))
        return sub.module if isinstance(sub, Cell) else sub

    # -- tensors ------------------------------------------------------------------------

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every parameter, then every buffer, of the model, each once, under its name."""
        return list(self._named.values())

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The model's parameters, each once, under its name."""
        return [(n, t) for n, t in self._named.values() if isinstance(t, nn.Parameter)]

    def holders(self) -> dict[str, tuple[int, ...]]:
        """Each tensor's name -> the nodes holding it (several for a tensor used by several nodes)."""
        return {name: tuple(sorted(self._holders[key])) for key, (name, _) in self._named.items()}

    def stage_tensors(self, start: int, stop: int) -> list[tuple[str, torch.Tensor]]:
        """The parameters, then buffers, a stage running nodes ``[start, stop)`` holds, under their names."""
        return [(name, t) for key, (name, t) in self._named.items()
                if any(start <= i < stop for i in self._holders[key])]

    # -- stages -------------------------------------------------------------------------

    def stage_module(self, start: int, stop: int) -> fx.GraphModule:
        """A module running nodes ``[start, stop)``, sharing the model's parameters.

        It takes what crosses cut ``start`` (the model's inputs when ``start == 0``) and returns
        what crosses cut ``stop`` (the model's output when ``stop == n``): one value when one
        crosses, a tuple of the values in graph order when several do.

        Raises:
            ValueError: If ``0 <= start < stop <= n`` does not hold.
        """
        n = len(self.nodes)
        if not 0 <= start < stop <= n:
            raise ValueError(f"nodes [{start}, {stop}) are not a range within the model's {n} nodes")
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        nodes = list(self.module.graph.nodes)
        if start == 0:
            for node in (nd for nd in nodes if nd.op == "placeholder"):
                env[node] = g.node_copy(node)
        else:
            incoming = self._crossing[start]
            if len(incoming) == 1:
                env[incoming[0]] = g.placeholder(incoming[0].name)
            else:
                values = g.placeholder("values")
                for i, node in enumerate(incoming):
                    env[node] = g.call_function(operator.getitem, (values, i))
        for node in nodes:
            inside = (any(start <= u < stop for u in self._attr_users[node]) if node.op == "get_attr"
                      else start <= self._group_of.get(node, -1) < stop)
            if inside:
                env[node] = g.node_copy(node, lambda x: env[x])
        if stop == n:
            out = next(nd for nd in nodes if nd.op == "output")
            g.output(fx.map_arg(out.args[0], lambda x: env[x]))
        else:
            outgoing = self._crossing[stop]
            g.output(env[outgoing[0]] if len(outgoing) == 1 else tuple(env[nd] for nd in outgoing))
        g.lint()
        return fx.GraphModule(self.module, g, class_name=f"Stage_{start}_{stop}")

    def __str__(self) -> str:
        rows = [f"{'node':>4}  {'name':<24} crossing after it"]
        for node in self.nodes:
            rows.append(f"{node.index:>4}  {node.name:<24} "
                        + ", ".join(nd.name for nd in self._crossing[node.index + 1]))
        return "\n".join(rows)

