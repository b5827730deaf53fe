"""Profiling a graph on a sample microbatch: per-node times and bytes, per-cut crossing bytes.

Each node runs alone as its own stage module (``Graph.stage_module(i, i + 1)``, taking and
returning the values of its cuts flattened: :class:`_FlatNode`) on the tensors that really
reach it, so a node's time excludes its neighbours and its memory is what it alone holds.
Activation bytes are the bytes autograd saves for the backward (distinct storages, parameters
excluded), measured with saved-tensor hooks.

[Note: profile timing] A node's forward and backward are timed at two microbatch sizes:
the sample's ``b`` and ``SCALE_FACTOR * b`` (the sample repeated along its batch
dimension), and fitted as ``t(n) = fixed + per_sample * n``. Small microbatches cost more
per sample than large ones (a GEMM over 8 rows reads the whole weight as one over 64
does), so linear scaling from 8 samples predicted 3-4x the measured step of a 64-sample
one. Each size is timed ``repeats`` times and at least until ``MIN_TIMED_S`` of timed
runs (at most ``MAX_REPEATS``), after ``warmup`` untimed runs, in rounds that play the nodes
as a step plays a stage ([Note: a node's turn]), and the lower quartile is kept: on a shared machine
slow outliers are interference, not the node's cost, and rounds spread a burst of it over all nodes. A
model that cannot run at the larger size (a fixed batch), or whose inputs have no known batch
dimension, falls back to linear scaling.

[Note: a node's turn] A node's time depends on what ran before it: its weights (4 MB for one of
bench.models:mlp's 1024-wide blocks) are fast to read right after its own last run and slow after its
neighbours' work has evicted them. A step never runs a node's backward right after its forward: a
stage runs its nodes' forwards in order, then (after the other microbatches') their backwards in
reverse. So a round plays each run of consecutive nodes that way: every forward, every forward again
(a second microbatch), every backward in reverse, then the same split as ``I`` in reverse and ``W`` in
order ([Note: the backward's halves]), and a round's nodes hold their graphs until their backward (at
most ``WINDOW_BYTES`` of saved activations at the larger size; a larger model plays in several runs).
Before, each node ran forward, forward again and backward at once, so its backward and its halves
were timed with its weights warm: on 2026-12-01, with the host's caches busy, a stage of four of those
blocks (8 microbatches of 8, its ``I`` s deferring as GPipe's do, one process) took 1.45x what that
profile priced for its forwards and ``I`` s (0.69 of the stage, 0.53-0.73 over 8 alternated runs), and
the pipelines of bench/train.py ran their ``I`` s at 1.2-2.4x the price. Played in turns, 0.88
(0.75-0.99) and 0.95 (0.76-1.10) in two sets of alternated runs.

[Note: a warm forward] A node's forward costs less when its weights are still in the caches from the
last microbatch. A round times each forward twice ([Note: a node's turn]): once after the rest of the
round's work (``forward_s``: a stage's first microbatch, which comes after the optimizer step and the
rest of the step) and once after every node's first (``warm_forward_s``: its later microbatches). The
planner prices a stage's forwards at the warm time and the difference once per step
(``coordinator/planning/planner.py``). The warm time was once the node's forward run again at once:
0.57 ms against 0.85 cold on 8-sample microbatches of bench.models:mlp's blocks on 2026-11-28, when
the pipelines of bench/train.py ran four blocks in 2.61-2.77 ms, the warm time. On 2026-12-01 the same
host ran a stage's later forwards at its first's (4.15-6.09 ms against 4.65-6.23 for four blocks, one
process) while a node run again at once still took 0.8 of its cold time: what a stage finds in the
caches is the host's of the moment, which a round measures and a run at once does not. A stage much
smaller than a round's run of nodes may find its weights warmer than priced.

[Note: the backward's halves] How a step's worker runs a backward depends on its schedule
(``services/compute/weight_grads.py``): a plain ``B`` (autograd makes each weight gradient as a new
tensor and adds it into ``.grad``), an ``I`` (the input gradients alone, the linear layers' weight
gradients deferred) and a ``W`` (those weight gradients, one ``addmm_`` into ``.grad`` per layer).
On 8-sample microbatches of 1024-wide linear layers, ``I`` + ``W`` took 0.85x the plain ``B`` and a
GPipe stage's ``I`` s with its one ``W`` over all its microbatches 0.65x. So a node with eligible
linear layers is also timed as ``I`` and ``W`` (``NodeProfile.input_backward_s``, ``weight_s``) in
each round after its plain runs ([Note: a node's turn]), at both sizes, and the planner prices each
schedule's backwards as its workers run them.

[Note: a flush's rows] A flush of held ``W`` s is one product over many microbatches' rows (GPipe's and
a lone 1F1B replica's: every microbatch of the step, 64 rows on the benchmark's 8 x 8). The product's
time is not affine in its rows: below ~16 rows of 1024-wide layers it is bound by the pass over the
weight gradient, above by the arithmetic. Measured in one process, one thread, 4 x Linear(1024) in
place: 2.0 / 2.0 / 3.0 / 5.9 / 11.6 ms at 8 / 16 / 32 / 64 / 128 rows, so the fit from 8 and 32 rows
gave 4.4 ms at 64 (0.75x). So the larger size's ``W`` is also timed at ``FLUSH_FACTOR`` times the
sample's rows, as the executor flushes it (its rows queued ``FLUSH_FACTOR / SCALE_FACTOR`` times, one
product: ``NodeProfile.weight_flush_s``), and :meth:`NodeProfile.halves_at` joins the two: affine up
to ``SCALE_FACTOR``, the line through ``SCALE_FACTOR`` and ``FLUSH_FACTOR`` past it. It adds one
product per node and round at the larger size: a job's profile (at least 3 runs a node and size) took
1.21 s on bench/train.py's MLP as before and 1.32 s against 1.28 on its uneven model; one of at least
15 runs 1.91 s against 1.48 and 2.81 against 2.14 (one process, medians of 3, under load).

The result is a :class:`Profile`: a frozen pydantic model, saved and loaded as JSON, so a
profile taken once can be reused (and one can be written by hand, :meth:`Profile.synthetic`).
Times hold for the profiled microbatch size; :meth:`Profile.node_times` gives them at
another size (affine in the size; bytes scale linearly).
"""

from __future__ import annotations

import bisect
import contextlib
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from coordinator.planning import runtime_bytes as runtime
from coordinator.planning.graph import CutInfo, Graph, TensorMeta, use_snapshot
from services.compute.weight_grads import WeightGradStore, eligible_layers

__all__ = ["FLUSH_FACTOR", "MAX_REPEATS", "MIN_TIMED_S", "OPTIMIZER_STATE_FACTORS",
           "OPTIMIZER_STEP_TEMPORARY_FACTORS", "SCALE_FACTOR", "WINDOW_BYTES", "NodeProfile", "NodeTable",
           "Profile", "format_bytes", "profile_graph"]

SCALE_FACTOR = 4  # the second profiled size, in multiples of the sample's (see [Note: profile timing])
FLUSH_FACTOR = 16  # the rows a flush's W is timed at, in multiples of the sample's ([Note: a flush's rows])
MIN_TIMED_S = 0.05  # timed runs per node and size last at least this long in total...
MAX_REPEATS = 50  # ...but no more runs than this
# the most autograd saves for one round's nodes at the larger size ([Note: a node's turn])
WINDOW_BYTES = 256 << 20

# Optimizer state per byte of trainable parameter: Adam keeps two moments, momentum SGD one.
OPTIMIZER_STATE_FACTORS: dict[str, float] = {"sgd": 0.0, "momentum": 1.0, "adam": 2.0, "adamw": 2.0}
# What the optimizer's step allocates at once, per byte of the parameter it is stepping: torch's
# per-parameter Adam computes ``exp_avg_sq.sqrt() / bias_correction`` (two temporaries of the
# parameter's size; measured: 2.0 x the largest parameter above the state); SGD steps in place.
OPTIMIZER_STEP_TEMPORARY_FACTORS: dict[str, float] = {"sgd": 0.0, "momentum": 0.0, "adam": 2.0, "adamw": 2.0}


def format_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``: binary units, three significant digits."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class NodeProfile(BaseModel):
    """What one node costs for one microbatch of the profiled size.

    ``forward_fixed_s`` / ``backward_fixed_s`` are the parts of ``forward_s`` / ``backward_s``
    that do not grow with the microbatch size (0: the time scales linearly).
    ``activation_bytes`` is what autograd saves in the forward (held until the backward);
    ``deferred_bytes`` what a stage that defers its linear layers' weight gradients holds from
    the backward to the step's weight gradients (``services/compute/weight_grads.py``);
    ``step_temporary_bytes`` what the optimizer's step allocates at once for the node's largest
    trainable parameter (:data:`OPTIMIZER_STEP_TEMPORARY_FACTORS`; 0 in a profile written before it);
    ``largest_param_bytes`` that parameter's bytes (its gradient is the smallest bucket it travels in).
    ``input_backward_s`` / ``weight_s`` (with their fixed parts): the backward as ``I`` and ``W`` (see
    [Note: the backward's halves]); both 0 where not measured (no eligible linear layer, or a profile
    written before them): the plain backward stands for both then. ``deferred_weight_bytes``: the
    weights of the layers whose gradients it defers (what a flush of held ``W`` s streams; 0: none, or
    not measured). ``weight_flush_s``: ``W`` in place at ``weight_flush_scale`` times the profiled
    microbatch, one product as a flush runs it ([Note: a flush's rows]; 0: not measured).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    forward_s: float = Field(ge=0)
    backward_s: float = Field(ge=0)
    forward_fixed_s: float = Field(default=0.0, ge=0)
    backward_fixed_s: float = Field(default=0.0, ge=0)
    param_bytes: int = Field(ge=0)
    buffer_bytes: int = Field(default=0, ge=0)
    grad_bytes: int = Field(ge=0)
    optimizer_state_bytes: int = Field(ge=0)
    activation_bytes: int = Field(ge=0)
    deferred_bytes: int = Field(default=0, ge=0)
    step_temporary_bytes: int = Field(default=0, ge=0)
    largest_param_bytes: int = Field(default=0, ge=0)
    input_backward_s: float = Field(default=0.0, ge=0)
    weight_s: float = Field(default=0.0, ge=0)
    input_backward_fixed_s: float = Field(default=0.0, ge=0)
    weight_fixed_s: float = Field(default=0.0, ge=0)
    deferred_weight_bytes: int = Field(default=0, ge=0)
    weight_flush_s: float = Field(default=0.0, ge=0)
    weight_flush_scale: float = Field(default=0.0, ge=0)
    # the forward of a second microbatch, after every node's first ([Note: a warm forward]); None: not
    # measured (the forward stands for it)
    warm_forward_s: float | None = Field(default=None, ge=0)
    warm_forward_fixed_s: float = Field(default=0.0, ge=0)

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s

    @model_validator(mode="after")
    def _fixed_within(self) -> NodeProfile:
        pairs = ((self.forward_fixed_s, self.forward_s), (self.backward_fixed_s, self.backward_s),
                 (self.input_backward_fixed_s, self.input_backward_s), (self.weight_fixed_s, self.weight_s),
                 (self.warm_forward_fixed_s, self.warm_forward_s if self.warm_forward_s is not None else 0.0))
        if any(fixed > whole for fixed, whole in pairs):
            raise ValueError(f"node {self.name}: a fixed part exceeds its whole time")
        if self.warm_forward_s is not None and self.warm_forward_s > self.forward_s:
            raise ValueError(f"node {self.name}: its warm forward ({self.warm_forward_s}s) exceeds its "
                             f"forward ({self.forward_s}s)")
        return self

    @property
    def split(self) -> bool:
        """Whether its backward was timed as ``I`` and ``W`` too."""
        return self.input_backward_s > 0 or self.weight_s > 0

    def halves_at(self, scale: float) -> tuple[float, float]:
        """``I`` and ``W`` seconds at ``scale`` times the profiled microbatch size (unsplit: the plain
        backward and 0)."""
        if not self.split:
            return self.times_at(scale)[1], 0.0
        i0, w0 = self.input_backward_fixed_s, self.weight_fixed_s
        w = w0 + (self.weight_s - w0) * scale
        top = self.weight_flush_scale
        if self.weight_flush_s > 0 and top > SCALE_FACTOR and scale > SCALE_FACTOR:
            at = w0 + (self.weight_s - w0) * SCALE_FACTOR  # the fit's upper point ([Note: a flush's rows])
            w = max(0.0, at + (self.weight_flush_s - at) * (scale - SCALE_FACTOR) / (top - SCALE_FACTOR))
        return i0 + (self.input_backward_s - i0) * scale, w

    def times_at(self, scale: float) -> tuple[float, float]:
        """Forward and backward seconds at ``scale`` times the profiled microbatch size."""
        f0, b0 = self.forward_fixed_s, self.backward_fixed_s
        return f0 + (self.forward_s - f0) * scale, b0 + (self.backward_s - b0) * scale

    def warm_at(self, scale: float) -> float:
        """The warm forward's seconds at ``scale`` times the profiled microbatch size (not measured: the
        forward's), never above the forward's."""
        if self.warm_forward_s is None:
            return self.times_at(scale)[0]
        w0 = self.warm_forward_fixed_s
        return min(w0 + (self.warm_forward_s - w0) * scale, self.times_at(scale)[0])


class NodeTable:
    """Every node's timing fields as arrays, to price all the nodes at a microbatch size in one pass: the
    same arithmetic, in the same order, as :meth:`NodeProfile.times_at`, :meth:`~NodeProfile.warm_at` and
    :meth:`~NodeProfile.halves_at` per node (so the same floats), for the planner's searches over many
    sizes."""

    def __init__(self, nodes: Sequence[NodeProfile]) -> None:
        def col(name: str) -> np.ndarray:
            return np.array([getattr(nd, name) for nd in nodes], dtype=np.float64)

        self.f, self.f0 = col("forward_s"), col("forward_fixed_s")
        self.b, self.b0 = col("backward_s"), col("backward_fixed_s")
        self.i, self.i0 = col("input_backward_s"), col("input_backward_fixed_s")
        self.w, self.w0 = col("weight_s"), col("weight_fixed_s")
        self.flush, self.top = col("weight_flush_s"), col("weight_flush_scale")
        self.measured = np.array([nd.warm_forward_s is not None for nd in nodes])
        self.warm = np.array([nd.warm_forward_s or 0.0 for nd in nodes], dtype=np.float64)
        self.warm0 = col("warm_forward_fixed_s")
        self.split = np.array([nd.split for nd in nodes])

    def times_at(self, scale: float) -> tuple[np.ndarray, np.ndarray]:
        """Every node's forward and backward seconds at ``scale`` (:meth:`NodeProfile.times_at`)."""
        return self.f0 + (self.f - self.f0) * scale, self.b0 + (self.b - self.b0) * scale

    def warm_at(self, scale: float) -> np.ndarray:
        """Every node's warm forward at ``scale`` (:meth:`NodeProfile.warm_at`)."""
        forward = self.f0 + (self.f - self.f0) * scale
        warm = np.minimum(self.warm0 + (self.warm - self.warm0) * scale, forward)
        chosen: np.ndarray = np.where(self.measured, warm, forward)
        return chosen

    def halves_at(self, scale: float) -> tuple[np.ndarray, np.ndarray]:
        """Every node's ``I`` and ``W`` at ``scale`` (:meth:`NodeProfile.halves_at`)."""
        w = self.w0 + (self.w - self.w0) * scale
        if scale > SCALE_FACTOR:
            flushed = (self.flush > 0) & (self.top > SCALE_FACTOR)
            if flushed.any():
                at = self.w0 + (self.w - self.w0) * SCALE_FACTOR
                with np.errstate(divide="ignore", invalid="ignore"):
                    line = np.maximum(0.0, at + (self.flush - at) * (scale - SCALE_FACTOR)
                                      / (self.top - SCALE_FACTOR))
                w = np.where(flushed, line, w)
        backward = self.b0 + (self.b - self.b0) * scale
        return (np.where(self.split, self.i0 + (self.i - self.i0) * scale, backward),
                np.where(self.split, w, 0.0))


class Profile(BaseModel):
    """A profiled chain: ``n`` nodes and ``n + 1`` cuts (see ``coordinator/planning/graph.py``).

    ``runtime_bytes``: what a worker's runtime maps besides tensors
    (``coordinator/planning/runtime_bytes.py``; 0 in a profile written by hand or before it was measured).
    ``ties``: the nodes that hold one trainable parameter together (tied weights, one group per
    parameter that several nodes hold); a plan that cuts between them ties the stages
    (``coordinator/runtime/tied.py``), which ZeRO-2 and 3 cannot run.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: int = 1
    microbatch_size: int = Field(ge=1)
    repeats: int = Field(ge=1)
    optimizer: str
    device: str = "cpu"  # where it was measured ("cpu", "cuda:0"): its times hold for workers of that kind
    runtime_bytes: int = Field(default=0, ge=0)
    nodes: tuple[NodeProfile, ...] = Field(min_length=1)
    cuts: tuple[CutInfo, ...]
    ties: tuple[tuple[int, ...], ...] = ()

    @model_validator(mode="after")
    def _shape(self) -> Profile:
        if len(self.cuts) != len(self.nodes) + 1:
            raise ValueError(f"{len(self.nodes)} nodes need {len(self.nodes) + 1} cuts, got {len(self.cuts)}")
        if [c.index for c in self.cuts] != list(range(len(self.cuts))):
            raise ValueError("cuts must be numbered 0..n in order")
        for group in self.ties:
            if len(group) < 2 or list(group) != sorted(set(group)) or group[-1] >= len(self.nodes):
                raise ValueError(f"a tie {list(group)} must name 2 or more distinct nodes in order, of "
                                 f"{len(self.nodes)}")
        return self

    def tied_across(self, bounds: Sequence[int]) -> bool:
        """Whether a plan cutting at ``bounds`` (``0 = b_0 < ... < b_p = n``) puts the holders of a tied
        parameter on different stages."""
        return any(bisect.bisect_right(bounds, group[0]) != bisect.bisect_right(bounds, group[-1])
                   for group in self.ties)

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    def node_times(self, size: float) -> list[tuple[float, float]]:
        """Every node's (forward, backward) seconds for a microbatch of ``size`` samples."""
        return [nd.times_at(size / self.microbatch_size) for nd in self.nodes]

    def node_warm(self, size: float) -> list[float]:
        """Every node's warm forward seconds for a microbatch of ``size`` samples ([Note: a warm forward])."""
        return [nd.warm_at(size / self.microbatch_size) for nd in self.nodes]

    def node_halves(self, size: float) -> list[tuple[float, float]]:
        """Every node's (``I``, ``W``) seconds for a microbatch of ``size`` samples (see
        [Note: the backward's halves]; a node not split: its plain backward and 0)."""
        return [nd.halves_at(size / self.microbatch_size) for nd in self.nodes]

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.model_dump_json(indent=1), encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        """Reads a profile written by :meth:`save`.

        Raises:
            pydantic.ValidationError: If the file is not a valid profile.
        """
        return cls.model_validate_json(Path(path).read_text(encoding="utf-8"))

    def __str__(self) -> str:
        rows = [f"profile: {self.num_nodes} nodes, microbatch {self.microbatch_size}, {self.device}, "
                f"lower quartile of >= {self.repeats} runs, optimizer {self.optimizer}",
                f"{'#':>3} {'node':<18} {'fwd ms':>8} {'bwd ms':>8} {'params':>10} {'saved act':>10} "
                f"{'cut after':>10}"]
        for i, nd in enumerate(self.nodes):
            rows.append(f"{i:>3} {nd.name:<18} {nd.forward_s * 1e3:>8.3f} {nd.backward_s * 1e3:>8.3f} "
                        f"{format_bytes(nd.param_bytes):>10} {format_bytes(nd.activation_bytes):>10} "
                        f"{format_bytes(self.cuts[i + 1].forward_bytes):>10}")
        return "\n".join(rows)

    @classmethod
    def synthetic(cls, forward_s: Sequence[float], *, backward_s: Sequence[float] | None = None,
                  param_bytes: Sequence[int] | None = None, activation_bytes: Sequence[int] | None = None,
                  cut_bytes: Sequence[int] | None = None, microbatch_size: int = 1,
                  optimizer: str = "adam", deferred_bytes: Sequence[int] | None = None) -> Profile:
        """A profile written by hand (for tests, examples and what-if planning).

        Args:
            forward_s: Forward time per node; backward defaults to twice forward.
            backward_s: Backward time per node.
            param_bytes: Trainable parameter bytes per node (default 0).
            activation_bytes: Saved activation bytes per node (default 0).
            cut_bytes: Bytes crossing each inner cut 1..n-1 (length n-1; default 0), one
                float32 tensor per cut that needs a gradient, batch dimension 0.
            microbatch_size: The microbatch size the numbers describe.
            optimizer: A key of :data:`OPTIMIZER_STATE_FACTORS`.
            deferred_bytes: Bytes held per node for deferred weight gradients (default 0).
        """
        n = len(forward_s)
        deferred = list(deferred_bytes) if deferred_bytes is not None else [0] * n
        bwd = list(backward_s) if backward_s is not None else [2 * f for f in forward_s]
        params = list(param_bytes) if param_bytes is not None else [0] * n
        acts = list(activation_bytes) if activation_bytes is not None else [0] * n
        inner = list(cut_bytes) if cut_bytes is not None else [0] * (n - 1)
        factor = OPTIMIZER_STATE_FACTORS[optimizer]
        nodes = tuple(NodeProfile(name=f"n{i}", forward_s=forward_s[i], backward_s=bwd[i],
                                  param_bytes=params[i], grad_bytes=params[i],
                                  optimizer_state_bytes=int(params[i] * factor), activation_bytes=acts[i],
                                  deferred_bytes=deferred[i])
                      for i in range(n))

        def cut(c: int, nbytes: int) -> CutInfo:
            meta = TensorMeta(name=f"x{c}", shape=(microbatch_size, nbytes // 4 // microbatch_size),
                              dtype="float32", requires_grad=c > 0, nbytes=nbytes, batch_dim=0)
            return CutInfo(index=c, tensors=(meta,))

        cuts = (cut(0, 0), *(cut(c, inner[c - 1]) for c in range(1, n)), cut(n, 0))
        return cls(microbatch_size=microbatch_size, repeats=1, optimizer=optimizer, device="synthetic",
                   nodes=nodes, cuts=cuts)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, tuple | list):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _saved_bytes(module: torch.nn.Module, inputs: list[torch.Tensor]) -> tuple[int, int]:
    """The bytes autograd saves for one forward of ``module``, and the bytes a stage deferring its
    linear layers' weight gradients holds after the backward: each deferred layer call's input and
    output (its output gradient's size; ``services/compute/weight_grads.py``)."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    storages: dict[int, int] = {}
    deferred = [0]

    def count(_: torch.nn.Module, args: tuple[Any, ...], out: Any) -> None:
        deferred[0] += sum(t.numel() * t.element_size() for t in _tensors([args, out]))

    def pack(t: torch.Tensor) -> torch.Tensor:
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return t
        if st.data_ptr() not in params:
            storages[st.data_ptr()] = st.nbytes()
        return t

    handles = [layer.register_forward_hook(count) for _, layer in eligible_layers(module)]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            module(*inputs)
    finally:
        for handle in handles:
            handle.remove()
    return sum(storages.values()), deferred[0]


def _fresh(values: list[Any], names: tuple[str, ...], grad: set[str]) -> list[Any]:
    """New leaves for the tensors among ``values`` (needing a gradient where recorded so), each one that
    needs a gradient given as a copy, as a stage gives its module what it receives: a node may change
    its input in place ([Note: received values change in place] in ``services/compute/executor.py``)."""
    out: list[Any] = []
    for v, nm in zip(values, names, strict=True):
        if isinstance(v, torch.Tensor):
            x = v.detach()
            v = x.requires_grad_(nm in grad and (x.is_floating_point() or x.is_complex()))
            v = v.clone() if v.requires_grad else v
        out.append(v)
    return out


class _FlatNode(torch.nn.Module):
    """Node ``index`` of ``graph`` taking and returning the flattened values of its cuts.

    Profiling keeps one tensor per crossing name (tiled, made a fresh leaf), so the node's stage
    module gets its values packed as a stage takes them; its output is flattened back, but the
    last node's, which is the model's output.
    """

    def __init__(self, graph: Graph, index: int) -> None:
        super().__init__()
        self.stage = graph.stage_module(index, index + 1)
        self._graph, self._index = graph, index

    def forward(self, *flat: Any) -> Any:
        out = self.stage(*self._graph.pack(self._index, flat))
        last = self._index + 1 == len(self._graph)
        return out if last else tuple(self._graph.unpack(self._index + 1, out))


def _restore_grads(saved: dict[torch.nn.Parameter, torch.Tensor | None]) -> None:
    for p, g in saved.items():
        p.grad = g


def _robust(samples: list[float]) -> float:
    """The lower quartile of ``samples`` (the minimum of fewer than 4)."""
    if len(samples) < 4:
        return min(samples)
    return statistics.quantiles(samples, n=4, method="inclusive")[0]


class _Timings:
    """The timed runs of one node at one size (see [Note: profile timing])."""

    def __init__(self, module: torch.nn.Module, args: list[Any], names: tuple[str, ...],
                 grad: set[str], copies: int = 0) -> None:
        self.module, self.args, self.names, self.grad = module, args, names, grad
        self.copies = copies  # > 1: also time W over this many times its rows ([Note: a flush's rows])
        self.flushed: list[float] = []
        # CUDA runs asynchronously: its times are taken once the device finished
        self.cuda = any(t.is_cuda for t in [*module.parameters(), *_tensors(args)])
        self.fwd: list[float] = []
        self.warm: list[float] = []  # a second microbatch's forward ([Note: a warm forward])
        self.bwd: list[float] = []
        # the backward's halves ([Note: the backward's halves]), where the node has layers to defer
        layers = eligible_layers(module)
        self.store = WeightGradStore(module) if layers else None
        self.layer_ids = {id(m) for _, m in layers}  # the modules the store patches while it defers
        self.inp: list[float] = []
        self.wgt: list[float] = []
        # a round's state between its phases (see _play)
        self._outs: list[torch.Tensor] = []
        self._split = False
        self._deferring = contextlib.ExitStack()

    def done(self, repeats: int) -> bool:
        spent = sum(self.fwd) + sum(self.bwd) + sum(self.inp) + sum(self.wgt) + sum(self.flushed)
        return len(self.fwd) >= repeats and (spent >= MIN_TIMED_S or len(self.fwd) >= MAX_REPEATS)

    def forward(self, timed: bool) -> None:
        """The node's forward, its graph kept for :meth:`backward`."""
        ins = _fresh(self.args, self.names, self.grad)
        self._sync()
        t0 = time.perf_counter()
        out = self.module(*ins)
        self._sync()
        if timed:
            self.fwd.append(time.perf_counter() - t0)
        self._outs = [t for t in _tensors(out) if t.requires_grad]

    def forward_again(self, timed: bool) -> None:
        """The forward of a second microbatch, after every node's first ([Note: a warm forward])."""
        again = _fresh(self.args, self.names, self.grad)
        self._sync()
        t0 = time.perf_counter()
        self.module(*again)  # its graph is dropped at once
        self._sync()
        if timed:
            self.warm.append(time.perf_counter() - t0)

    def backward(self, timed: bool) -> None:
        """The backward of :meth:`forward`'s graph."""
        outs, self._outs = self._outs, []
        self._sync()
        t0 = time.perf_counter()
        if outs:
            torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
        self._sync()
        if timed:
            self.bwd.append(time.perf_counter() - t0 if outs else 0.0)
        self._split = bool(outs) and self.store is not None

    def deferred_forward(self) -> None:
        """The forward again (not timed) with the node's linear layers deferring their weight gradients,
        for :meth:`input_backward` and :meth:`weight` ([Note: the backward's halves])."""
        if not self._split:
            return
        assert self.store is not None
        self._deferring.enter_context(self.store.deferring())
        self.store.microbatch = 0
        out = self.module(*_fresh(self.args, self.names, self.grad))
        self.store.microbatch = None
        self._outs = [t for t in _tensors(out) if t.requires_grad]

    def input_backward(self, timed: bool) -> None:
        """``I``: the deferred forward's backward, the weight gradients queued."""
        if not self._split:
            return
        outs, self._outs = self._outs, []
        self._sync()
        t0 = time.perf_counter()
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
        self._sync()
        if timed:
            self.inp.append(time.perf_counter() - t0)

    def weight(self, timed: bool) -> None:
        """``W``: the queued weight gradients added in place into the ``.grad`` the plain run left; the
        larger size's also over ``copies`` times its rows in one product ([Note: a flush's rows])."""
        if not self._split:
            return
        assert self.store is not None
        try:
            if self.copies > 1:
                self.store.repeat(0, range(1, self.copies + 1))
            self._sync()
            t1 = time.perf_counter()
            self.store.flush([0], check=False)
            self._sync()
            t2 = time.perf_counter()
            if self.copies > 1:  # the copies' rows in one product, as a flush of held W's
                self.store.flush(range(1, self.copies + 1), check=False)
                self._sync()
                if timed:
                    self.flushed.append(time.perf_counter() - t2)
            if timed:
                self.wgt.append(t2 - t1)
        finally:
            self.close()

    def close(self) -> None:
        """Forget a round left midway: its graphs, and the deferring layers restored."""
        self._outs = []
        self._deferring.close()

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def result(self) -> tuple[float, float]:
        return _robust(self.fwd), _robust(self.bwd)

    def warm_forward(self) -> float:
        """A second microbatch's forward (at most the first's: [Note: a warm forward])."""
        return min(_robust(self.warm), _robust(self.fwd))

    def halves(self) -> tuple[float, float]:
        """``I`` and ``W`` (0, 0 where not timed)."""
        return (_robust(self.inp), _robust(self.wgt)) if self.inp else (0.0, 0.0)

    def flush(self) -> float:
        """``W`` over ``copies`` times the rows (0 where not timed)."""
        return _robust(self.flushed) if self.flushed else 0.0


def _windows(timings: list[_Timings], saved: list[int], budget: int) -> list[list[_Timings]]:
    """``timings`` cut into runs of consecutive nodes whose graphs (``saved``: each node's bytes autograd
    saves) hold at most ``budget`` bytes together (at least one node each)."""
    out: list[list[_Timings]] = []
    held = budget + 1
    for t, nbytes in zip(timings, saved, strict=True):
        if held + nbytes > budget:
            out.append([])
            held = 0
        out[-1].append(t)
        held += nbytes
    return out


def _apart(timings: list[_Timings]) -> list[list[_Timings]]:
    """``timings`` cut into runs of consecutive nodes no two of which defer the same layer (a module
    called by two nodes: only one store may patch it at a time)."""
    out: list[list[_Timings]] = [[]]
    patched: set[int] = set()
    for t in timings:
        if t.layer_ids & patched:
            out.append([])
            patched = set()
        out[-1].append(t)
        patched |= t.layer_ids
    return out


def _play(timings: list[_Timings], timed: bool) -> None:
    """One round of consecutive nodes, as a step runs them ([Note: a node's turn])."""
    try:
        for t in timings:
            t.forward(timed)
        for t in timings:
            t.forward_again(timed)
        for t in reversed(timings):
            t.backward(timed)
        for run in _apart(timings):
            for t in run:
                t.deferred_forward()
            for t in reversed(run):
                t.input_backward(timed)
            for t in run:
                t.weight(timed)
    finally:
        for t in timings:
            t.close()


def _time_all(groups: list[list[_Timings]], repeats: int, warmup: int) -> None:
    """Time every node in rounds until each has enough runs: each round plays every group
    (consecutive nodes at one size, :func:`_windows`) once, its nodes that still want runs.

    Round robin spreads a burst of load from elsewhere on the machine over every node instead of
    one node entirely.
    """
    for group in groups:
        for _ in range(warmup):
            _play(group, timed=False)
    while any(not t.done(repeats) for group in groups for t in group):
        for group in groups:
            if left := [t for t in group if not t.done(repeats)]:
                _play(left, timed=True)


def _tile(value: Any, batch_dim: int | None, factor: int) -> Any:
    if not isinstance(value, torch.Tensor) or batch_dim is None:
        return value
    return torch.cat([value.detach()] * factor, dim=batch_dim)


def _resized(value: Any, batch_dim: int | None, size: int) -> Any:
    """``value`` with ``size`` samples along ``batch_dim``: its own tiled and cut (not a tensor, or no batch
    dimension: as it is)."""
    if not isinstance(value, torch.Tensor) or batch_dim is None:
        return value
    value = value.detach()
    whole, rest = divmod(size, value.shape[batch_dim])
    return torch.cat([value] * whole + [value.narrow(batch_dim, 0, rest)], dim=batch_dim)  # a storage of size


def _cuts_at(cuts: Sequence[CutInfo], size: int, sample_size: int) -> tuple[CutInfo, ...]:
    """``cuts`` (recorded on ``sample_size`` samples) for microbatches of ``size``."""
    if size == sample_size:
        return tuple(cuts)
    return tuple(c.model_copy(update={"tensors": tuple(t.at_batch(size, sample_size) for t in c.tensors)})
                 for c in cuts)


def _affine(small: float, large: float, size: int, factor: int) -> tuple[float, float]:
    """(time at ``size``, its fixed part) from times at ``size`` and ``factor * size``."""
    per_sample = max(0.0, (large - small) / ((factor - 1) * size))
    return small, min(small, max(0.0, small - per_sample * size))


def profile_graph(graph: Graph, sample: torch.Tensor | tuple[Any, ...], *, repeats: int = 5, warmup: int = 1,
                  optimizer: str = "adam", num_threads: int | None = None, size: int | None = None,
                  scaled: bool = True) -> Profile:
    """Measures every node of ``graph`` on ``sample`` (the microbatch the graph was built with).

    The runs leave no trace on the model: gradients, buffers (batch-norm statistics) and
    torch's RNG state are restored afterwards.

    Args:
        graph: From :func:`coordinator.planning.graph.build_graph`.
        sample: The sample inputs, as given to ``build_graph``.
        repeats: The fewest timed runs per node and size (see [Note: profile timing]).
        warmup: Untimed runs per node and size before the timed ones.
        optimizer: A key of :data:`OPTIMIZER_STATE_FACTORS` (sets optimizer-state bytes).
        num_threads: Torch intra-op threads while measuring (restored afterwards); set it to
            a worker's ``cpus``. None keeps the current setting. On a loaded machine, more
            threads than free cores make every op wait for a descheduled thread.
        size: Time microbatches of this many samples instead of the sample's own (its inputs tiled
            along their batch dimensions); the profile's ``microbatch_size`` and cut bytes are this
            size's. ``Job.plan()`` prices its plan on one at the plan's own size ([Note: the plan's own
            size] in ``coordinator/runtime/job.py``).
        scaled: Also time the larger size and the flush ([Note: profile timing], [Note: a flush's
            rows]); False: the one size alone, times scaling linearly from it (cheaper, exact at it).

    Raises:
        ValueError: If ``repeats`` or ``size`` is < 1, the optimizer is unknown, or ``size`` is given for a
            graph whose inputs have no known batch dimension.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if size is not None and size < 1:
        raise ValueError(f"size must be >= 1 samples, got {size}")
    if optimizer not in OPTIMIZER_STATE_FACTORS:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {', '.join(OPTIMIZER_STATE_FACTORS)}")
    runtime.start()  # a fresh interpreter measures it meanwhile (see [Note: the runtime's bytes])
    inputs = sample if isinstance(sample, tuple) else (sample,)
    placeholders = [nd for nd in graph.module.graph.nodes if nd.op == "placeholder"]
    values: dict[str, Any] = {}
    for nd, x in zip(placeholders, inputs, strict=False):
        values[nd.name] = x
        if isinstance(x, tuple | list):
            values.update((f"{nd.name}.{i}", v) for i, v in enumerate(x))
        elif isinstance(x, dict):
            values.update((f"{nd.name}.{k}", v) for k, v in x.items())
    batch_dims = {m.name: m.batch_dim for m in graph.cuts[0].tensors}
    batched = any(isinstance(values[nm], torch.Tensor) and batch_dims.get(nm) is not None
                  for nm in graph.flat_names(0))
    if size is not None and size != graph.sample_batch:
        if not batched:
            raise ValueError(f"cannot profile {size} samples: no input of the graph has a known batch "
                             f"dimension (profile its own {graph.sample_batch})")
        values.update({nm: _resized(values[nm], batch_dims.get(nm), size) for nm in graph.flat_names(0)})
    large: dict[str, Any] | None = {nm: _tile(values[nm], batch_dims.get(nm), SCALE_FACTOR)
                                    for nm in graph.flat_names(0)}
    if not batched or not scaled:
        large = None  # no input with a known batch dimension (or not asked for): linear scaling
    saved_grads = {p: p.grad for p in graph.module.parameters()}
    saved_threads = torch.get_num_threads()
    factor = OPTIMIZER_STATE_FACTORS[optimizer]
    size = graph.sample_batch if size is None else size
    nodes = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(use_snapshot(graph.module))
        stack.callback(torch.set_num_threads, saved_threads)
        stack.callback(_restore_grads, saved_grads)
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        small: list[_Timings] = []
        big: list[_Timings] = []
        for node in graph.nodes:  # every node's inputs at both sizes, from the previous nodes' outputs
            i = node.index
            module = _FlatNode(graph, i)
            names = graph.flat_names(i)
            grad = {m.name for m in graph.cuts[i].tensors if m.requires_grad}
            args = [values[nm] for nm in names]
            small.append(_Timings(module, args, names, grad))
            if large is not None:
                try:
                    big.append(_Timings(module, [large[nm] for nm in names], names, grad,
                                        FLUSH_FACTOR // SCALE_FACTOR))
                    with torch.no_grad():
                        out = module(*big[-1].args)
                    if i + 1 < len(graph.nodes):
                        large.update(zip(graph.flat_names(i + 1), out, strict=True))
                except Exception:  # the model does not run at the larger size: linear scaling
                    large, big = None, []
            if i + 1 < len(graph.nodes):
                with torch.no_grad():
                    out = module(*args)
                values.update(zip(graph.flat_names(i + 1), out, strict=True))
        held = [_saved_bytes(t.module, _fresh(t.args, t.names, t.grad)) for t in small]
        # the larger size's graphs held at once bound a round's nodes, at both sizes ([Note: a node's turn])
        graph_bytes = [saved * SCALE_FACTOR for saved, _ in held]
        windows = _windows(small, graph_bytes, WINDOW_BYTES)
        try:
            both = [*windows, *_windows(big, graph_bytes, WINDOW_BYTES)] if big else windows
            _time_all(both, repeats, warmup)
        except Exception:
            if not big:
                raise
            large, big = None, []  # a backward failed at the larger size: linear scaling
            _time_all(windows, repeats, warmup)
        for i, node in enumerate(graph.nodes):
            t = small[i]
            fwd, bwd = t.result()
            warm = t.warm_forward()
            inp, wgt = t.halves()
            fwd_fixed, bwd_fixed, inp_fixed, wgt_fixed, flushed, warm_fixed = 0.0, 0.0, 0.0, 0.0, 0.0, 0.0
            if big:
                fwd_big, bwd_big = big[i].result()
                warm, warm_fixed = _affine(warm, big[i].warm_forward(), size, SCALE_FACTOR)
                fwd, fwd_fixed = _affine(fwd, fwd_big, size, SCALE_FACTOR)
                bwd, bwd_fixed = _affine(bwd, bwd_big, size, SCALE_FACTOR)
                inp_big, wgt_big = big[i].halves()
                inp, inp_fixed = _affine(inp, inp_big, size, SCALE_FACTOR)
                wgt, wgt_fixed = _affine(wgt, wgt_big, size, SCALE_FACTOR)
                flushed = big[i].flush()
            params = list(t.module.parameters())
            trainable = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
            largest = max((p.numel() * p.element_size() for p in params if p.requires_grad), default=0)
            saved, deferred = held[i]
            nodes.append(NodeProfile(
                name=node.name, forward_s=fwd, backward_s=bwd, forward_fixed_s=fwd_fixed,
                warm_forward_s=warm, warm_forward_fixed_s=warm_fixed,
                backward_fixed_s=bwd_fixed,
                param_bytes=sum(p.numel() * p.element_size() for p in params),
                buffer_bytes=sum(b.numel() * b.element_size() for b in t.module.buffers()),
                grad_bytes=trainable, optimizer_state_bytes=int(trainable * factor),
                activation_bytes=saved, deferred_bytes=deferred,
                step_temporary_bytes=int(largest * OPTIMIZER_STEP_TEMPORARY_FACTORS[optimizer]),
                largest_param_bytes=largest, input_backward_s=inp, weight_s=wgt,
                input_backward_fixed_s=inp_fixed, weight_fixed_s=wgt_fixed,
                deferred_weight_bytes=t.store.weight_bytes() if t.store is not None else 0,
                weight_flush_s=flushed, weight_flush_scale=FLUSH_FACTOR if flushed > 0 else 0.0,
            ))
    device = next((str(p.device) for p in graph.module.parameters()), "cpu")
    learned = {name for name, p in graph.chain.named_parameters() if p.requires_grad}
    ties = tuple(sorted(nodes_ for name, nodes_ in graph.chain.holders().items()
                        if name in learned and len(nodes_) > 1))
    return Profile(microbatch_size=size, repeats=repeats, optimizer=optimizer, device=device,
                   nodes=tuple(nodes), cuts=_cuts_at(graph.cuts, size, graph.sample_batch),
                   runtime_bytes=runtime.runtime_bytes(), ties=ties)
