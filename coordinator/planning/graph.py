"""A traced model's chain with, for every cut, the exact tensors alive across it, recorded on a sample.

The chain itself -- tracing with torch.fx, which modules are nodes (the leaf rule and
``model.leaves``), which values cross which cut ([Note: liveness]) and the module of any range
of nodes -- is :mod:`services.compute.chain`'s: the workers build their stages from it without a
sample. This module runs the model once on a sample microbatch (the coordinator's) and records
what the planner and the boundary specs need: every crossing tensor's name, shape, dtype and
whether it carries a gradient.

A value crossing a cut alone may be a tensor, or a tuple, list or dict of tensors: it is
flattened (``name.0``, ``name.key``). Several values crossing one cut (a skip connection beside
the main path: ``structure="values"``) must each be a tensor. A cut crossed by anything else
(an int, a string, a tuple beside another value) is marked uncuttable with the reason.

Shapes are recorded at the sample's batch size; a second pass at twice the batch size finds
each tensor's batch dimension, so a runtime can size buffers for any microbatch
(:meth:`TensorMeta.at_batch`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict
from torch import fx, nn

from services.compute.chain import Chain, ChainNode, trace_chain

__all__ = ["CutInfo", "Graph", "TensorMeta", "build_graph", "describe_value", "use_snapshot"]


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


def _reason(crossing: Sequence[fx.Node], values: dict[fx.Node, Any]) -> str | None:
    """Why the values ``crossing`` a cut cannot cross between stages, or None when they can."""
    if not crossing:
        return "nothing crosses it (the nodes after it use nothing the nodes before it compute)"
    for node in crossing:
        leaves = _leaves(node.name, values[node])
        if isinstance(leaves, str):
            return leaves
        if len(crossing) > 1 and not isinstance(values[node], torch.Tensor):
            return (f"{node.name} is a {type(values[node]).__name__} crossing beside "
                    f"{len(crossing) - 1} other value(s); beside others only tensors can cross")
    return None


class Graph:
    """A traced model as a chain of nodes with the crossing tensors of every cut.

    Attributes:
        chain: The chain (``services/compute/chain.py``): nodes, liveness, stage modules.
        module: The traced ``fx.GraphModule`` (it shares parameters with the user's model).
        nodes: The ``n`` cuttable nodes, in order.
        cuts: ``n + 1`` cuts; ``cuts[c]`` lists the tensors alive between node ``c-1`` and ``c``.
        sample_batch: The batch size the shapes were recorded at.
    """

    def __init__(self, chain: Chain, values: dict[fx.Node, Any], batch_dims: dict[str, int | None],
                 sample_batch: int) -> None:
        self.chain = chain
        self.module = chain.module
        self.nodes: tuple[ChainNode, ...] = chain.nodes
        self.sample_batch = sample_batch
        # _flat[v]: how a crossing value is flattened: whole (None: a tensor, or not flattenable)
        # or one tensor per key (tuple/list positions, dict keys)
        self._flat: dict[fx.Node, tuple[Structure, tuple[Any, ...]] | None] = {}
        cuts = []
        for c in range(len(chain) + 1):
            crossing = chain.crossing(c)
            tensors: list[TensorMeta] = []
            for node in crossing:
                shape = _structure(values[node])
                self._flat[node] = shape if shape is not None and shape[0] != "tensor" else None
                leaves = _leaves(node.name, values[node])
                if not isinstance(leaves, str):
                    tensors += [_meta(nm, t).model_copy(update={"batch_dim": batch_dims.get(nm)})
                                for nm, t in leaves]
            single = _structure(values[crossing[0]]) if len(crossing) == 1 else None
            structure = single[0] if single is not None else "values"
            cuts.append(CutInfo(index=c, tensors=tuple(tensors), structure=structure,
                                uncuttable_reason=_reason(crossing, values)))
        self.cuts = tuple(cuts)

    def __len__(self) -> int:
        return len(self.nodes)

    def flat_names(self, cut: int) -> tuple[str, ...]:
        """The names of the values crossing ``cut``, flattened as ``cuts[cut].tensors`` names them.

        Equal to the names of ``cuts[cut].tensors`` when the cut is cuttable; an uncuttable cut
        also lists its non-tensor values (whole).
        """
        names: list[str] = []
        for node in self.chain.crossing(cut):
            flat = self._flat[node]
            names += [node.name] if flat is None else [f"{node.name}.{k}" for k in flat[1]]
        return tuple(names)

    def pack(self, cut: int, flat: Sequence[Any]) -> tuple[Any, ...]:
        """The positional arguments of a stage starting at ``cut``, from the values of :meth:`flat_names`."""
        values: list[Any] = []
        rest = list(flat)
        for node in self.chain.crossing(cut):
            shape = self._flat[node]
            if shape is None:
                values.append(rest.pop(0))
                continue
            kind, keys = shape
            parts, rest = rest[:len(keys)], rest[len(keys):]
            values.append(dict(zip(keys, parts, strict=True)) if kind == "dict"
                          else list(parts) if kind == "list" else tuple(parts))
        if cut == 0 or len(values) == 1:
            return tuple(values)
        return (tuple(values),)

    def unpack(self, cut: int, out: Any) -> list[Any]:
        """What a stage ending at inner cut ``cut`` returned, as the values of :meth:`flat_names`."""
        crossing = self.chain.crossing(cut)
        values = [out] if len(crossing) == 1 else list(out)
        flat: list[Any] = []
        for node, value in zip(crossing, values, strict=True):
            shape = self._flat[node]
            flat += [value] if shape is None else [value[k] for k in shape[1]]
        return flat

    def stage_module(self, start: int, stop: int) -> fx.GraphModule:
        """The module running nodes ``[start, stop)`` (:meth:`services.compute.chain.Chain.stage_module`)."""
        return self.chain.stage_module(start, stop)

    def __str__(self) -> str:
        rows = [f"{'node':>4}  {'name':<20} {'ops':>3}  crossing after it"]
        for node in self.nodes:
            cut = self.cuts[node.index + 1]
            crossing = ", ".join(f"{t.name}{list(t.shape)}" for t in cut.tensors)
            flag = "" if cut.cuttable else f"  (uncuttable: {cut.uncuttable_reason})"
            rows.append(f"{node.index:>4}  {node.name:<20} {len(node.ops):>3}  {crossing}{flag}")
        return "\n".join(rows)


def _doubled(value: Any) -> Any:
    """``value`` with every tensor of it (in tuples, lists and dicts too) twice along dim 0."""
    if isinstance(value, torch.Tensor):
        return torch.cat([value, value]) if value.dim() > 0 else value
    if isinstance(value, tuple | list):
        return type(value)(_doubled(v) for v in value)
    if isinstance(value, dict):
        return {k: _doubled(v) for k, v in value.items()}
    return value


def _tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """The tensors of ``value`` and of the tuples, lists and dicts in it, in order."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, tuple | list):
        for v in value:
            yield from _tensors_in(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors_in(v)


def _batch_dims(gm: fx.GraphModule, values: dict[fx.Node, Any],
                inputs: tuple[Any, ...]) -> dict[str, int | None]:
    doubled = tuple(_doubled(x) for x in inputs)  # a tuple or dict of inputs too (several arguments)
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


def _failure(rec: _Recorder, chain: Chain, exc: Exception) -> str:
    """Which node failed on the sample, on what, and why (the first paragraph of torch's message)."""
    node = rec.current
    why = " ".join(str(exc).split("\n\n", 1)[0].split()) or type(exc).__name__
    if node is None:
        return f"the model fails on the sample: {type(exc).__name__}: {why}"
    given = ", ".join(describe_value(rec.values[a]) for a in node.all_input_nodes if a in rec.values)
    group = chain.group_of(node)
    where = chain.nodes[group].name if group is not None else node.name
    return f"node {where!r} ({node.target}) fails on {given or 'no inputs'}: {type(exc).__name__}: {why}"


def build_graph(model: Chain | nn.Module | Sequence[nn.Module], sample: torch.Tensor | tuple[Any, ...], *,
                leaves: Iterable[str] = ()) -> Graph:
    """Traces ``model`` into a chain of cuttable nodes (unless it is one) and records every cut's tensors.

    Args:
        model: A :class:`~services.compute.chain.Chain`, or what a model factory returns: a
            sequence of cells or modules, or any ``nn.Module`` (traced with ``leaves``).
        sample: One sample microbatch: a tensor or a tuple of positional inputs; batch
            dimension first.
        leaves: Qualified names of submodules kept as one node each (``model.leaves``).

    Returns:
        The graph; it shares parameters with ``model``.

    Raises:
        services.compute.chain.UntraceableError: torch.fx cannot trace the model (the message
            names the submodule and how to proceed).
        ValueError: Cell names repeat, a leaf names no submodule, or the model fails on the
            sample (the message names the node and the shapes it was given).
    """
    chain = model if isinstance(model, Chain) else trace_chain(model, leaves)
    inputs = sample if isinstance(sample, tuple) else (sample,)
    rec = _Recorder(chain.module)
    with use_snapshot(chain.module):
        try:
            rec.run(*inputs)
        except Exception as exc:
            raise ValueError(_failure(rec, chain, exc)) from exc
        batch_dims = _batch_dims(chain.module, rec.values, inputs)
    first = next((x for x in _tensors_in(inputs) if x.dim() > 0), None)
    batch = int(first.shape[0]) if first is not None else 1
    return Graph(chain, rec.values, batch_dims, batch)
