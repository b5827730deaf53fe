"""One pipeline stage built from an assignment: its nodes of the model, on the ends the samples and the loss.

Factories are named, never shipped: ``"package.module:function"`` (``Assignment.factory``,
``ComputeOptions.data`` and ``ComputeOptions.loss``), resolved by the worker through its
allow-list (``services/factories.py``): a name that is not one of its job's factories is
refused before anything is imported. Contracts:

* model factory ``f(**factory_kwargs)`` returns the whole model: a sequence of modules or
  cells (see :func:`services.compute.cell.as_cells`) or any ``nn.Module`` torch.fx traces.
  It runs under ``torch.manual_seed(seed)`` in a forked RNG, so every stage (and a
  single-process reference seeded alike) gets the same parameters. The stage traces it as
  the coordinator did (``services/compute/chain.py``, with ``ComputeOptions.leaves``) and
  keeps nodes ``[start, stop)`` (``Assignment.nodes``): one way to build a stage for every
  model, a cell sequence's node being a cell. Every stage builds the whole model and drops
  what it does not run: simple and deterministic, at the cost of building it (not keeping
  it) on each worker. The stage checks its boundary specs against its own trace, so a
  factory that builds another model on a worker is refused at assignment, not trained.
  With ``ComputeOptions.recompute`` it also keeps each node as a module of its own
  (:attr:`Stage.pieces`), which the executor runs checkpointed (``services/compute/recompute.py``).
* data factory ``f(**data_kwargs)`` (seeded the same way) returns either a pair
  ``(inputs, targets)``, each a tensor, tuple, list or dict of tensors with the samples
  along dim 0 (every tensor as many rows: a target per input, checked by
  :func:`sample_count`), or a callable ``load(indices: list[int]) -> (inputs, targets)``
  returning one row per index.
* loss factory ``f(**loss_kwargs)`` returns ``loss(output, targets) -> scalar tensor``;
  a loss module class works as is (``"torch.nn:MSELoss"``).
* held-out data factory (``ComputeOptions.eval_data``, optional): the data factory's contract,
  built on the first and last stages, read by evaluation steps (``RunStep.source = "eval"``).
* metric factory ``f()`` (``ComputeOptions.metric``, optional, last stage) returns
  ``metric(output, targets) -> tensor``: one value per sample, or one value, their mean
  (:func:`metric_sum`).

Device. The stage's cells live on ``ComputeOptions.device`` (``cpu`` or ``cuda:N``, the coordinator's
choice; the worker refuses a device its torch does not see); samples are loaded on the CPU and moved
there (:func:`to_device`), as the executor does with what it receives.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from services.compute.chain import Chain, trace_chain
from services.factories import FactoryAllowList
from services.protocol import Assignment, BoundarySpec, ComputeOptions, OptimizerSpec

__all__ = [
    "LossFn",
    "SampleError",
    "SampleSource",
    "Stage",
    "build_stage",
    "check_eval",
    "check_samples",
    "make_optimizer",
    "metric_sum",
    "sample_count",
    "stage_device",
    "to_device",
]

LossFn = Callable[[Any, Any], torch.Tensor]
_CPU = torch.device("cpu")
Loader = Callable[[list[int]], tuple[Any, Any]]


class SampleError(ValueError):
    """The data factory's samples are inconsistent; the message names the factory and the lengths."""


def _seeded(seed: int, fn: Callable[[], Any]) -> Any:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return fn()


def _take(value: Any, index: torch.Tensor, what: str) -> Any:
    if isinstance(value, torch.Tensor):
        return value.index_select(0, index)
    if isinstance(value, tuple | list):
        return type(value)(_take(v, index, what) for v in value)
    if isinstance(value, dict):
        return {k: _take(v, index, what) for k, v in value.items()}
    raise ValueError(f"{what}: samples must be tensors, tuples, lists or dicts of tensors, got "
                     f"{type(value).__name__}")


def to_device(value: Any, device: torch.device) -> Any:
    """``value`` (a tensor, or tuples, lists and dicts of them and of other values) with its tensors on
    ``device`` (the same tensors when they are there already)."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple | list):
        return type(value)(to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    return value


def stage_device(options: ComputeOptions) -> torch.device:
    """The device ``options`` put the stage on, checked against this process's CUDA devices.

    Raises:
        ValueError: A CUDA device this process does not see (naming what it sees and the fix).
    """
    device = torch.device(options.device)
    if device.type != "cuda":
        return device
    seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device.index is None or device.index >= seen:
        raise ValueError(f"the coordinator placed the stage on {options.device}, but this worker's torch "
                         f"sees {seen} CUDA device(s) (torch.cuda.is_available() is "
                         f"{torch.cuda.is_available()}): check its LOCAL_RANK and CUDA_VISIBLE_DEVICES, or "
                         "set runtime.device: cpu")
    return device


def _lengths(value: Any, name: str) -> list[tuple[str, int | None]]:
    """``(name, rows)`` of every tensor in ``value`` (None: a 0-dim tensor, which holds no samples)."""
    if isinstance(value, torch.Tensor):
        return [(name, int(value.shape[0]) if value.dim() else None)]
    if isinstance(value, dict):
        return [entry for key, v in value.items() for entry in _lengths(v, f"{name}.{key}")]
    if isinstance(value, tuple | list):
        return [entry for key, v in enumerate(value) for entry in _lengths(v, f"{name}.{key}")]
    return []


def sample_count(inputs: Any, targets: Any, *, what: str) -> int:
    """How many samples ``inputs`` and ``targets`` hold: the rows (dim 0) every tensor of both has.

    Raises:
        SampleError: Their tensors differ in length (say 256 inputs but 200 targets: training would
            silently drop or misalign samples), one is 0-dim, or there is no tensor at all.
    """
    rows = _lengths(inputs, "inputs") + _lengths(targets, "targets")
    scalar = next((name for name, n in rows if n is None), None)
    if scalar is not None:
        raise SampleError(f"{what}: {scalar} is a 0-dim tensor; every tensor needs the samples along dim 0")
    by_count: dict[int | None, list[str]] = {}
    for name, n in rows:
        by_count.setdefault(n, []).append(name)
    if not by_count:
        raise SampleError(f"{what}: the inputs and targets hold no tensor")
    if len(by_count) > 1:
        listed = " but ".join(f"{n} {'/'.join(names)}" for n, names in by_count.items())
        raise SampleError(f"{what} returns {listed} (samples along dim 0): every input needs its target; "
                          "give them the same length")
    return next(iter(by_count)) or 0


class SampleSource:
    """The samples of a job, by index: ``load(indices) -> (inputs, targets)``.

    Attributes:
        num_samples: How many samples there are, when the source knows (index checks).
    """

    def __init__(self, made: Any, *, what: str) -> None:
        """Raises SampleError: ``made`` is neither a pair nor a loader, or its lengths differ."""
        self._what = what
        self._loader: Loader | None = None
        self._pair: tuple[Any, Any] | None = None
        self.num_samples: int | None = None
        if callable(made):
            self._loader = made
        elif isinstance(made, tuple | list) and len(made) == 2:
            self._pair = (made[0], made[1])
            self.num_samples = sample_count(made[0], made[1], what=what)
        else:
            raise SampleError(f"{what}: the data factory must return (inputs, targets) or a callable "
                              f"load(indices) -> (inputs, targets), got {type(made).__name__}")

    def load(self, indices: list[int]) -> tuple[Any, Any]:
        """The samples at ``indices`` as ``(inputs, targets)``, ``len(indices)`` rows each.

        Raises:
            SampleError: A loader returned another number of rows, or inputs and targets of
                different lengths (the message names the data factory).
        """
        if self._loader is not None:
            loaded = self._loader(indices)
            if not (isinstance(loaded, tuple | list) and len(loaded) == 2):
                raise SampleError(f"{self._what}: load(indices) must return (inputs, targets), got "
                                  f"{type(loaded).__name__}")
            n = sample_count(loaded[0], loaded[1], what=f"{self._what}'s load({len(indices)} indices)")
            if n != len(indices):
                raise SampleError(f"{self._what}: load({len(indices)} indices) returned {n} samples; it "
                                  "must return one per index")
            return loaded[0], loaded[1]
        assert self._pair is not None
        index = torch.tensor(indices, dtype=torch.long)
        return _take(self._pair[0], index, self._what), _take(self._pair[1], index, self._what)


def metric_sum(value: Any, num_samples: int, *, what: str) -> float:
    """The sum over a microbatch's ``num_samples`` samples of what a metric returned for them.

    A metric returns one value per sample (``numel == num_samples``: summed) or one value, their mean
    (multiplied by ``num_samples``); either way the mean over many microbatches is exact.

    Raises:
        ValueError: ``value`` is not a tensor of either size (the message names the metric).
    """
    if not isinstance(value, torch.Tensor) or value.numel() not in (1, num_samples):
        got = (f"a tensor of shape {list(value.shape)}" if isinstance(value, torch.Tensor)
               else type(value).__name__)
        raise ValueError(f"{what} returned {got} for {num_samples} samples; return one value per sample "
                         "(shape [n]) or their mean (one value)")
    total = value.detach().double().sum()
    return float(total) * (num_samples if value.numel() == 1 else 1)


@dataclass
class Stage:
    """What one compute service runs: nodes ``[start, stop)`` of the model, stage ``index`` of ``num_stages``.

    ``tensors`` are the parameters, then the buffers, the stage holds, under their names in
    the model (``services/compute/chain.py``): what its checkpoint part and its replies name.
    ``eval_samples`` (first and last stage) and ``metric_fn`` (last stage) are set when the job evaluates.
    """

    index: int
    num_stages: int
    start: int
    stop: int
    nodes: tuple[str, ...]  # the names of its nodes
    module: nn.Module
    tensors: list[tuple[str, torch.Tensor]]
    samples: SampleSource | None
    loss_fn: LossFn | None
    loss_reduction: str
    incoming: BoundarySpec | None
    outgoing: BoundarySpec | None
    device: torch.device = _CPU  # where the cells live (the samples are moved there)
    eval_samples: SampleSource | None = None
    metric_fn: LossFn | None = None
    # recompute (ComputeOptions.recompute): the stage's nodes one module each, run in a row in place of
    # ``module``, each checkpointed (services/compute/recompute.py); None: ``module`` runs
    pieces: list[nn.Module] | None = None

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.num_stages - 1

    def parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The stage's parameters under their names in the model (a tied one once)."""
        return [(name, t) for name, t in self.tensors if isinstance(t, nn.Parameter)]

    def state(self) -> list[tuple[str, torch.Tensor]]:
        """Parameters, then buffers, each listed once: what a checkpoint holds."""
        return list(self.tensors)


def _check_boundary(chain: Chain, cut: int, spec: BoundarySpec, what: str) -> None:
    """Raise ValueError if ``spec`` is not what crosses cut ``cut`` of this process's trace of the model.

    One value crossing takes any structure but ``"values"``; several take ``"values"`` with their
    graph names, in order (what the coordinator's trace named them).
    """
    crossing = [nd.name for nd in chain.crossing(cut)]
    names = [t.name for t in spec.tensors]
    same = names == crossing if spec.structure == "values" else len(crossing) == 1
    if not same:
        raise ValueError(f"the plan's {what} ({spec.structure} {names}) is not what crosses cut {cut} of "
                         f"this worker's trace of the model ({crossing}): the model factory must build the "
                         "same model in every process (same code, same kwargs)")


def build_stage(assignment: Assignment, options: ComputeOptions, factories: FactoryAllowList) -> Stage:
    """Resolve the factories (only those ``factories`` allows) and build the stage an assignment describes.

    Every name is checked against ``factories`` before any is imported.

    Raises:
        ValueError: A factory is not one of the job's (:class:`~services.factories.FactoryError`),
            does not import or returns the wrong kind of thing, the model does not trace, the node
            range does not fit the model, or a boundary spec is not what crosses that cut here.
    """
    named = {"model factory": assignment.factory, "data factory": options.data, "loss factory": options.loss,
             "eval data factory": options.eval_data, "metric factory": options.metric}
    factories.require({what: name for what, name in named.items() if name})
    device = stage_device(options)
    factory = factories.resolve(assignment.factory, what="model factory")
    chain = trace_chain(_seeded(assignment.seed, lambda: factory(**options.factory_kwargs)), options.leaves)
    if len(assignment.nodes) != 2 or not 0 <= assignment.nodes[0] < assignment.nodes[1] <= len(chain):
        raise ValueError(f"nodes {assignment.nodes} is not a [start, stop) range within the model's "
                         f"{len(chain)} nodes {[nd.name for nd in chain.nodes]}")
    start, stop = assignment.nodes
    if options.incoming is not None and start > 0:
        _check_boundary(chain, start, options.incoming, "incoming boundary")
    if options.outgoing is not None and stop < len(chain):
        _check_boundary(chain, stop, options.outgoing, "outgoing boundary")
    first, last = options.stage == 0, options.stage == options.num_stages - 1
    samples = None
    if first or last:
        data = factories.resolve(options.data, what="data factory")
        samples = SampleSource(_seeded(assignment.seed, lambda: data(**options.data_kwargs)),
                               what=f"data factory {options.data!r}")
    loss_fn: LossFn | None = None
    if last:
        made = factories.resolve(options.loss, what="loss factory")(**options.loss_kwargs)
        if not callable(made):
            raise ValueError(f"loss factory {options.loss!r} returned a {type(made).__name__}, "
                             "not a callable")
        loss_fn = made.to(device) if isinstance(made, nn.Module) else made  # weights live with the outputs
    eval_samples, metric_fn = _eval_parts(assignment.seed, options, factories)
    if isinstance(metric_fn, nn.Module):
        metric_fn = metric_fn.to(device)
    names = tuple(nd.name for nd in chain.nodes[start:stop])
    module = chain.stage_module(start, stop).to(device)  # moves the model's own modules: tensors after it
    # recompute: one module per node, sharing the stage module's (see [Note: recompute per cell])
    pieces: list[nn.Module] | None = None
    if options.recompute:
        pieces = [chain.stage_module(i, i + 1).to(device) for i in range(start, stop)]
        # torch.utils.checkpoint imports torch._dynamo on its first call (seconds on a loaded CPU):
        # here, at assignment, rather than inside the first step's deadline
        importlib.import_module("torch._dynamo")
    return Stage(index=options.stage, num_stages=options.num_stages, start=start, stop=stop, nodes=names,
                 module=module, tensors=chain.stage_tensors(start, stop), samples=samples, loss_fn=loss_fn,
                 loss_reduction=options.loss_reduction, incoming=options.incoming, outgoing=options.outgoing,
                 device=device, eval_samples=eval_samples, metric_fn=metric_fn, pieces=pieces)


def _eval_parts(seed: int, options: ComputeOptions, factories: FactoryAllowList
                ) -> tuple[SampleSource | None, LossFn | None]:
    """The held-out samples (first and last stage; seeded as the training data) and the metric (last)."""
    samples = None
    last = options.stage == options.num_stages - 1
    if options.eval_data and (options.stage == 0 or last):
        data = factories.resolve(options.eval_data, what="eval data factory")
        samples = SampleSource(_seeded(seed, lambda: data(**options.eval_data_kwargs)),
                               what=f"eval data factory {options.eval_data!r}")
    metric_fn: LossFn | None = None
    if options.metric and last:
        made = factories.resolve(options.metric, what="metric factory")()
        if not callable(made):
            raise ValueError(f"metric factory {options.metric!r} returned a {type(made).__name__}, "
                             "not a callable metric(output, targets)")
        metric_fn = made
    return samples, metric_fn


def check_eval(stage: Stage, trains: bool) -> None:
    """Raise ValueError unless the stage can run an evaluation step of a list that ``trains`` or not."""
    if trains:
        raise ValueError("an evaluation step (source 'eval') runs no backward")
    if (stage.first or stage.last) and stage.eval_samples is None:
        raise ValueError(f"stage {stage.index} has no held-out data: the job's config has no eval "
                         "section (assign the stage with eval_data to evaluate)")


def check_samples(stage: Stage, microbatches: Sequence[Sequence[int]], source: str = "train") -> None:
    """Raise ValueError if a sample index is beyond what the stage's data source (``source``'s) holds."""
    samples = stage.eval_samples if source == "eval" else stage.samples
    if samples is None or samples.num_samples is None:
        return
    n = samples.num_samples
    for m, indices in enumerate(microbatches):
        bad = [i for i in indices if i >= n]
        if bad:
            raise ValueError(f"microbatch {m}: sample indices {bad[:5]} are beyond the {n} samples "
                             f"of the {'held-out ' if source == 'eval' else ''}data")


def make_optimizer(spec: OptimizerSpec, params: Sequence[torch.Tensor], *,
                   fused: bool = False) -> torch.optim.Optimizer:
    """The ``torch.optim`` optimizer ``spec`` names, over ``params`` (list kwargs become tuples: betas).

    A stage may hold no parameters (a cut that leaves an activation alone on a stage): torch's
    optimizers refuse an empty list, so the optimizer then holds one empty placeholder, which never
    gets a gradient and so is never updated; its learning rate still follows a scheduler.

    ``fused``: torch's fused implementation where the class has one for the parameters' device and
    dtype and ``spec`` chooses none (no ``foreach``, ``fused``, ``capturable`` or ``differentiable``).
    [Note: the fused optimizer] torch's default on the CPU loops over the parameters in Python, a few
    ops each, and over every element once per op: AdamW over the GPT of ``bench/zero.py`` (102 tensors,
    1.7 M parameters) 4-5 ms a step against 1.0-1.4 ms fused, over 8 x Linear(1024) 81 ms against 5 ms
    (one thread). Adam, AdamW, SGD and Adagrad have one; their results equal the default's to the last
    bit or two of float64 (2e-16 after 5 steps). The workers' stages ask for it; the single-process
    reference (``coordinator/runtime/reference.py``) keeps torch's default, so the parity tests compare
    the two. The fused kernels take no sparse gradient; a job whose model makes one is refused by its
    checks (``coordinator/runtime/preflight.py``).

    Raises:
        ValueError: Not a ``torch.optim`` optimizer class, or it refuses the keyword arguments.
    """
    cls = getattr(torch.optim, spec.name, None)
    base = torch.optim.Optimizer
    if not (isinstance(cls, type) and issubclass(cls, base) and cls is not base):
        raise ValueError(f"{spec.name!r} is not a torch.optim optimizer class")
    kwargs: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in spec.kwargs.items()}
    make: Callable[..., torch.optim.Optimizer] = cls
    params = list(params) or [nn.Parameter(torch.empty(0))]
    if fused and not _IMPLEMENTATION.intersection(kwargs) and "fused" in inspect.signature(cls).parameters:
        try:
            return make(params, **kwargs, fused=True)
        except (TypeError, ValueError, RuntimeError):
            pass  # no fused kernel for these parameters (their device or dtype): torch's default below
    try:
        return make(params, **kwargs)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"optimizer {spec.name}({spec.kwargs}): {exc}") from None


_IMPLEMENTATION = frozenset({"foreach", "fused", "capturable", "differentiable"})  # a user's choice: kept
