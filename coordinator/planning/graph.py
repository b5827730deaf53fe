"""Model -> a chain of cuttable nodes, and for every cut the exact set of tensors alive across it.

A model is either a sequence of :class:`services.compute.cell.Cell` or any ``nn.Module`` that
``torch.fx`` can trace. Tracing stops at *leaf* modules, each of which starts a node of
the chain:

- a :class:`Cell`, wherever it sits;
- in a model without cells, each direct child of the root, or each child of a direct
  child that is a container (``nn.Sequential``/``ModuleList``/``ModuleDict``) -- so
  ``self.layers = nn.ModuleList(blocks)`` gives one node per block.

Free functions and methods between leaves (a residual ``+``, a ``flatten``) join the node
of the leaf before them (the first leaf, for those before any leaf). Cut ``c`` lies between
node ``c-1`` and node ``c``; cut 0 carries the model's inputs and cut ``n`` its outputs.

[Note: liveness] A value produced by node ``p`` (``p = -1`` for a model input) and last
used by node ``u`` (``u = n`` when the model returns it) is alive across every cut ``c``
with ``p < c <= u``. All of them must be sent across a cut placed at ``c``: a skip
connection from node 1 to node 4 crosses cuts 2, 3 and 4 and is relayed by every stage
in between. Tuples, lists and dicts of tensors are flattened (``name.0``, ``name.key``); a
cut crossed by anything else (an int, a string) is marked uncuttable with the reason.

Shapes are recorded at the sample's batch size; a second pass at twice the batch size finds
each tensor's batch dimension, so a runtime can size buffers for any microbatch
(:meth:`TensorMeta.at_batch`).
"""

from __future__ import annotations

import contextlib
import keyword
import operator
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict
from torch import fx, nn

from services.compute.cell import Cell

__all__ = ["CutInfo", "Graph", "GraphNode", "TensorMeta", "build_graph", "describe_value", "use_snapshot"]

LeafFn = Callable[[nn.Module, str], bool]
_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


class TensorMeta(BaseModel):
    """One tensor crossing a cut: what a stage must send and its neighbour receive."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    shape: tuple[int, ...]
    dtype: str
    requires_grad: bool
    nbytes: int
    batch_dim: int | None = None

    def at_batch(self, size: int, sample_size: int) -> TensorMeta:
        """This tensor for a microbatch of ``size`` samples (recorded at ``sample_size``)."""
        if self.batch_dim is None or size == sample_size:
            return self
        shape = list(self.shape)
        shape[self.batch_dim] = shape[self.batch_dim] * size // sample_size
        per = self.nbytes // max(1, self.shape[self.batch_dim])
        return self.model_copy(update={"shape": tuple(shape), "nbytes": per * shape[self.batch_dim]})


class CutInfo(BaseModel):
    """Cut ``index`` (between node ``index-1`` and ``index``) and every tensor alive across it.

    ``structure`` says how the tensors form what crosses: one value that is a ``"tensor"``,
    a ``"tuple"``, ``"list"`` or ``"dict"`` of tensors (named ``value.position`` /
    ``value.key``), or several ``"values"`` (skip connections), flattened in graph order.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    index: int
    tensors: tuple[TensorMeta, ...]
    structure: Literal["tensor", "tuple", "list", "dict", "values"] = "values"
    uncuttable_reason: str | None = None

    @property
    def cuttable(self) -> bool:
        return self.uncuttable_reason is None

    @property
    def forward_bytes(self) -> int:
        """Activation bytes one microbatch sends forward across this cut."""
        return sum(t.nbytes for t in self.tensors)

    @property
    def backward_bytes(self) -> int:
        """Gradient bytes one microbatch sends back across this cut."""
        return sum(t.nbytes for t in self.tensors if t.requires_grad)


@dataclass(frozen=True)
class GraphNode:
    """A cuttable node: one leaf module plus the free operations that follow it."""

    index: int
    name: str
    ops: tuple[str, ...]  # fx node names, in graph order


def _meta(name: str, t: torch.Tensor) -> TensorMeta:
    return TensorMeta(name=name, shape=tuple(t.shape), dtype=str(t.dtype).removeprefix("torch."),
                      requires_grad=t.requires_grad, nbytes=t.numel() * t.element_size())


Structure = Literal["tensor", "tuple", "list", "dict"]


def _structure(value: Any) -> tuple[Structure, tuple[Any, ...]] | None:
    """How a value flattens into tensors: its kind and its keys (positions or dict keys).

    None for anything else (an int, a nested tuple, a dict with non-str keys).
    """
    if isinstance(value, torch.Tensor):
        return "tensor", ()
    if isinstance(value, tuple | list) and all(isinstance(v, torch.Tensor) for v in value):
        return ("tuple" if isinstance(value, tuple) else "list"), tuple(range(len(value)))
    if isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                       for k, v in value.items()):
        return "dict", tuple(value)
    return None


def _leaves(name: str, value: Any) -> list[tuple[str, torch.Tensor]] | str:
    """A value's tensors as ``(name, tensor)``, or the reason it cannot cross a cut."""
    shape = _structure(value)
    if shape is None:
        return f"{name} is a {type(value).__name__}, not a tensor or a flat tuple, list or dict of tensors"
    kind, keys = shape
    return [(name, value)] if kind == "tensor" else [(f"{name}.{k}", value[k]) for k in keys]


class _Recorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.values: dict[fx.Node, Any] = {}
        self.current: fx.Node | None = None  # the node running (the one that failed, after an error)

    def run_node(self, n: fx.Node) -> Any:
        self.current = n
        out = super().run_node(n)
        self.values[n] = out
        return out


@contextlib.contextmanager
def use_snapshot(module: nn.Module) -> Iterator[None]:
    """Runs the block, then restores ``module``'s buffers and torch's CPU RNG state.

    Capturing and profiling run the user's model on samples; this keeps those runs from
    moving batch-norm statistics or the random stream the training will use.
    """
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    rng = torch.random.get_rng_state()
    try:
        yield
    finally:
        torch.random.set_rng_state(rng)
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)


def _as_tuple(*xs: Any) -> tuple[Any, ...]:
    return tuple(xs)


def _as_list(*xs: Any) -> list[Any]:
    return list(xs)


def _as_dict(keys: tuple[str, ...], *xs: Any) -> dict[str, Any]:
    return dict(zip(keys, xs, strict=True))


class _ChainTracer(fx.Tracer):
    def __init__(self, root: nn.Module, leaf: LeafFn | None) -> None:
        super().__init__()
        self._root = root
        self._leaf = leaf
        self._has_cells = any(isinstance(m, Cell) for m in root.modules())

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if self._leaf is not None:
            return self._leaf(m, module_qualified_name)
        if isinstance(m, Cell):
            return True
        if not self._has_cells:
            parent, _, _ = module_qualified_name.rpartition(".")
            if parent == "" and not isinstance(m, _CONTAINERS):
                return True
            if parent and "." not in parent and isinstance(self._root.get_submodule(parent), _CONTAINERS):
                return True
        return bool(super().is_leaf_module(m, module_qualified_name))


class Graph:
    """A traced model as a chain of nodes with the crossing tensors of every cut.

    Attributes:
        module: The traced ``fx.GraphModule`` (it shares parameters with the user's model).
        nodes: The ``n`` cuttable nodes, in order.
        cuts: ``n + 1`` cuts; ``cuts[c]`` lists the tensors alive between node ``c-1`` and ``c``.
        sample_batch: The batch size the shapes were recorded at.
    """

    def __init__(self, module: fx.GraphModule, group: dict[fx.Node, int], names: list[str],
                 values: dict[fx.Node, Any], batch_dims: dict[str, int | None], sample_batch: int) -> None:
        self.module = module
        self.sample_batch = sample_batch
        self._group = group
        n = len(names)
        ops: list[list[str]] = [[] for _ in range(n)]
        for node, g in group.items():
            ops[g].append(node.name)
        self.nodes = tuple(GraphNode(i, names[i], tuple(ops[i])) for i in range(n))
        self._crossing: list[list[fx.Node]] = [[] for _ in range(n + 1)]
        for node in module.graph.nodes:
            if node.op in ("output", "get_attr") or not node.users:
                continue
            born = -1 if node.op == "placeholder" else group[node]
            last = max(n if u.op == "output" else group[u] for u in node.users)
            for c in range(born + 1, last + 1):
                self._crossing[c].append(node)
        # _flat[v]: how a crossing value is passed: whole (None: a tensor, or not flattenable)
        # or flattened into one argument per key (tuple/list positions, dict keys)
        self._flat: dict[fx.Node, tuple[Structure, tuple[Any, ...]] | None] = {}
        cuts = []
        for c, crossing in enumerate(self._crossing):
            tensors: list[TensorMeta] = []
            reason: str | None = None
            for node in crossing:
                shape = _structure(values[node])
                self._flat[node] = shape if shape is not None and shape[0] != "tensor" else None
                leaves = _leaves(node.name, values[node])
                if isinstance(leaves, str):
                    reason = reason or leaves
                    continue
                tensors += [_meta(nm, t).model_copy(update={"batch_dim": batch_dims.get(nm)})
                            for nm, t in leaves]
            single = _structure(values[crossing[0]]) if len(crossing) == 1 else None
            structure = single[0] if single is not None else "values"
            cuts.append(CutInfo(index=c, tensors=tuple(tensors), structure=structure,
                                uncuttable_reason=reason))
        self.cuts = tuple(cuts)

    def __len__(self) -> int:
        return len(self.nodes)

    def boundary(self, cut: int) -> tuple[str, ...]:
        """The names of the values a stage starting at ``cut`` takes, in argument order.

        Equal to the names of ``cuts[cut].tensors`` when the cut is cuttable; an uncuttable
        cut also lists its non-tensor values (passed whole).
        """
        names: list[str] = []
        for node in self._crossing[cut]:
            flat = self._flat[node]
            names += [node.name] if flat is None else [f"{node.name}.{k}" for k in flat[1]]
        return tuple(names)

    def stage_module(self, start: int, stop: int) -> fx.GraphModule:
        """A module running nodes ``[start, stop)``.

        It takes the tensors of ``cuts[start]`` as positional arguments, in order (tuples
        flattened), and returns the tensors of ``cuts[stop]`` as a tuple, in order -- except
        the last stage (``stop == n``), which returns the model's output as the model does.
        Parameters are shared with the traced model.

        Raises:
            ValueError: If ``0 <= start < stop <= n`` does not hold.
        """
        n = len(self.nodes)
        if not 0 <= start < stop <= n:
            raise ValueError(f"stage [{start}, {stop}) is not within the {n} nodes")
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for node in self._crossing[start]:
            flat = self._flat[node]
            if flat is None:
                env[node] = g.placeholder(node.name)
                continue
            kind, keys = flat
            parts = tuple(g.placeholder(f"{node.name}_{i}") for i in range(len(keys)))
            if kind == "dict":
                env[node] = g.call_function(_as_dict, (keys, *parts))
            else:
                env[node] = g.call_function(_as_list if kind == "list" else _as_tuple, parts)
        for node in self.module.graph.nodes:
            if start <= self._group.get(node, -1) < stop:
                env[node] = g.node_copy(node, lambda x: env[x])
        if stop == n:
            out = next(nd for nd in self.module.graph.nodes if nd.op == "output")
            g.output(fx.map_arg(out.args[0], lambda x: env[x]))
        else:
            outs: list[fx.Node] = []
            for node in self._crossing[stop]:
                flat = self._flat[node]
                if flat is None:
                    outs.append(env[node])
                else:
                    outs += [g.call_function(operator.getitem, (env[node], k)) for k in flat[1]]
            g.output(tuple(outs))
        g.lint()
        return fx.GraphModule(self.module, g, class_name=f"Stage_{start}_{stop}")

    def __str__(self) -> str:
        rows = [f"{'node':>4}  {'name':<20} {'ops':>3}  crossing after it"]
        for node in self.nodes:
            cut = self.cuts[node.index + 1]
            crossing = ", ".join(f"{t.name}{list(t.shape)}" for t in cut.tensors)
            flag = "" if cut.cuttable else f"  (uncuttable: {cut.uncuttable_reason})"
            rows.append(f"{node.index:>4}  {node.name:<20} {len(node.ops):>3}  {crossing}{flag}")
        return "\n".join(rows)


def _group_nodes(gm: fx.GraphModule,
                 names_of: Callable[[fx.Node], str]) -> tuple[dict[fx.Node, int], list[str]]:
    group: dict[fx.Node, int] = {}
    names: list[str] = []
    pending: list[fx.Node] = []
    attrs: list[fx.Node] = []
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "get_attr":
            attrs.append(node)
        elif node.op == "call_module":
            names.append(names_of(node))
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
    for node in attrs:
        users = {group[u] for u in node.users if u in group}
        if len(users) > 1:
            raise ValueError(f"attribute {node.target!r} is used by nodes {sorted(names[u] for u in users)}; "
                             "a parameter shared across nodes cannot be cut apart, use it inside one module")
        group[node] = users.pop() if users else 0
    return group, names


def _batch_dims(gm: fx.GraphModule, values: dict[fx.Node, Any],
                inputs: tuple[Any, ...]) -> dict[str, int | None]:
    doubled = tuple(torch.cat([x, x]) if isinstance(x, torch.Tensor) and x.dim() > 0 else x for x in inputs)
    rec = _Recorder(gm)
    try:
        rec.run(*doubled)
    except Exception:  # the model does not take another batch size: leave batch dims unknown
        return {}
    dims: dict[str, int | None] = {}
    for node, value in values.items():
        one, two = _leaves(node.name, value), _leaves(node.name, rec.values.get(node))
        if isinstance(one, str) or isinstance(two, str) or len(one) != len(two):
            continue
        for (nm, a), (_, b) in zip(one, two, strict=True):
            diff = [d for d in range(a.dim()) if a.dim() == b.dim() and b.shape[d] == 2 * a.shape[d] != 0]
            dims[nm] = diff[0] if len(diff) == 1 else None
    return dims


def describe_value(value: Any) -> str:
    """A value by its shapes: ``[8, 12] float32``, ``([8, 6] float32, [8] int64)``, ``{h: [8] int64}``."""
    if isinstance(value, torch.Tensor):
        return f"{list(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, tuple | list):
        return "(" + ", ".join(describe_value(v) for v in value) + ")"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {describe_value(v)}" for k, v in value.items()) + "}"
    return f"a {type(value).__name__}"


def _failure(rec: _Recorder, group: dict[fx.Node, int], names: list[str], exc: Exception) -> str:
    """Which node failed on the sample, on what, and why (the first paragraph of torch's message)."""
    node = rec.current
    why = " ".join(str(exc).split("\n\n", 1)[0].split()) or type(exc).__name__
    if node is None:
        return f"the model fails on the sample: {type(exc).__name__}: {why}"
    given = ", ".join(describe_value(rec.values[a]) for a in node.all_input_nodes if a in rec.values)
    where = names[group[node]] if node in group else node.name
    return f"node {where!r} ({node.target}) fails on {given or 'no inputs'}: {type(exc).__name__}: {why}"


def build_graph(model: nn.Module | Sequence[Cell], sample: torch.Tensor | tuple[Any, ...], *,
                leaf: LeafFn | None = None) -> Graph:
    """Traces ``model`` into a chain of cuttable nodes and records every cut's tensors.

    Args:
        model: An ``nn.Module`` or a sequence of :class:`Cell` (run one after the other).
        sample: One sample microbatch: a tensor or a tuple of positional inputs; batch
            dimension first.
        leaf: Overrides which modules are leaves (nodes): ``leaf(module, qualified_name)``.

    Returns:
        The graph; it shares parameters with ``model``.

    Raises:
        ValueError: If cell names repeat, fx cannot trace the model (the message says how
            to make it traceable), a parameter is used by several nodes, or the model fails
            on the sample (the message names the node and the shapes it was given).
    """
    if not isinstance(model, nn.Module):
        cells = list(model)
        names = [c.name for c in cells]
        if len(set(names)) != len(names):
            raise ValueError(f"cell names must be unique, got {names}")
        # children named after their cells give readable value names; fx generates Python
        # source, so names that are keywords or clash with module attributes get a number
        keys = [nm if nm.isidentifier() and not keyword.iskeyword(nm) and not hasattr(nn.Sequential(), nm)
                else f"cell{i}" for i, nm in enumerate(names)]
        model = nn.Sequential(OrderedDict(zip(keys, cells, strict=True)))
    inputs = sample if isinstance(sample, tuple) else (sample,)
    try:
        tracer = _ChainTracer(model, leaf)
        gm = fx.GraphModule(model, tracer.trace(model))
    except Exception as exc:
        raise ValueError(f"torch.fx cannot trace {type(model).__name__}: {exc}. Wrap the untraceable "
                         "parts in Cells (cells are not traced into) or pass the model as a sequence "
                         "of Cells") from exc

    def name_of(node: fx.Node) -> str:
        sub = gm.get_submodule(str(node.target))
        return sub.name if isinstance(sub, Cell) else str(node.target)

    group, names = _group_nodes(gm, name_of)
    rec = _Recorder(gm)
    with use_snapshot(gm):
        try:
            rec.run(*inputs)
        except Exception as exc:
            raise ValueError(_failure(rec, group, names, exc)) from exc
        batch_dims = _batch_dims(gm, rec.values, inputs)
    first = next((x for x in inputs if isinstance(x, torch.Tensor) and x.dim() > 0), None)
    batch = int(first.shape[0]) if first is not None else 1
    return Graph(gm, group, names, rec.values, batch_dims, batch)
