"""The checks a job passes in the coordinator's process before any worker starts.

Each turns a mistake a new user makes into one line naming the cause and the fix, seconds
after the job is loaded, instead of a traceback, minutes of planning, or silently wrong
training. :func:`check_job` runs them in order, cheapest first:

0. the optimizer and its learning-rate scheduler, built by name over a throwaway parameter
   and stepped once, as every stage and shard will build them: an unknown or unsupported
   class, or arguments torch refuses, are one error naming the key;
1. the model's size, built under ``torch.device("meta")`` (shapes, no memory) where the
   factory allows: a model whose parameters, gradients and optimizer state no plan over
   the workers can hold is refused before it is allocated ([Note: the memory floor] in
   ``coordinator/planning/planner.py``). A factory that does not build on the meta device
   (it loads weights, calls ``.item()``...) is built for real first and measured then:
   still before any tracing or profiling, whose memory is several times the parameters';
2. the model traced into its chain of nodes (``services/compute/chain.py``): a submodule
   torch.fx cannot trace is named with the fix (``model.leaves``); then the stages the plan
   section asks for against the model's nodes (its cells, for a cell sequence);
3. the fixed replicas and microbatches against the global batch and the workers
   (``coordinator/planning/request.py``), and, for a model with BatchNorm layers, against the
   rule that each of their forwards sees the global batch (one microbatch per replica,
   collective mode: [Note: BatchNorm sees the global batch] in ``services/compute/batchnorm.py``);
4. the model built for real: a factory that raises is named with the line of the user's
   code that raised (``coordinator/runtime/factories.py``);
5. the data: inputs and targets of one length (``SampleSource``), its size known (and for
   tensors, no smaller than ``data.num_samples`` says), at least one global batch of samples,
   and a sample microbatch loads;
6. the sample through the nodes one by one (each node's stage module), then the loss: the
   first cell or node that fails is named with what it was given (``cell 'cell2' fails on the
   output of cell 'cell1', a [8, 12] float32 tensor: mat1 and mat2 shapes cannot be
   multiplied``), as is a loss that does not take the model's output and the targets;
   then the loss's gradients on the sample: a model with no parameter to train, a loss that does
   not depend on one (an output computed under ``no_grad`` or detached), a backward that raises,
   and a parameter whose gradient is not a dense tensor (``F.embedding(..., sparse=True)``:
   check 1 finds only the ``nn.Embedding`` layers built so) are each named with the fix;
7. with an ``eval`` section, checks 5 and 6 on the held-out data (its size known, a sample
   through the nodes in eval mode, then the loss), and the metric: its factory builds, and
   it returns one value per sample or one value (``services.compute.stage.metric_sum``);
8. the model's random draws, on 2 then 3 samples: one whose size follows the batch elsewhere
   than along dim 0 (dropout in a sequence-first layout) would differ between plans, and is
   named with the fix ([Note: randomness that survives the cut] in
   ``services/compute/randomness/mode.py``).

Failures are :class:`~coordinator.runtime.errors.JobError` (or ``PlanningError`` for a model
no plan holds); ``cellmesh run`` prints them as one line and exits 2. What passed is kept
for planning (:class:`Checked`): the built model's chain, the sample and the BatchNorm layers.
"""

from __future__ import annotations

import difflib
import inspect
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from coordinator.planning.config import JobConfig
from coordinator.planning.graph import describe_value, use_snapshot
from coordinator.planning.planner import CellBytes, check_memory_floor
from coordinator.planning.request import batch_norm_request, check_batch
from coordinator.planning.resources import Resources
from coordinator.runtime.errors import JobError, first_line, located
from coordinator.runtime.factories import (
    build_chain,
    build_data,
    build_loss,
    build_metric,
    chain_of,
    seeded,
    unwrapped,
)
from services.compute.batchnorm import batch_norm_layers
from services.compute.chain import Chain, call_model
from services.compute.executor import evaluating
from services.compute.randomness import Drawn, ModelRandomness, check_draws
from services.compute.randomness.names import module_names
from services.compute.stage import SampleError, SampleSource, make_optimizer, metric_sum
from services.factories import resolve
from services.params import scheduling
from services.params.zero import check_elementwise
from services.protocol import OptimizerSpec, SchedulerSpec

__all__ = ["Checked", "batch_norm_of", "check_enough_samples", "check_job", "check_optimizer",
           "model_structure", "node_bytes", "optimizer_keywords", "sample_size"]

log = logging.getLogger(__name__)

SAMPLE_MAX = 8  # samples in the microbatch the checks (and the profile) run


@dataclass
class Checked:
    """What passed :func:`check_job`: the model's chain of nodes with its initial parameters, and a sample."""

    chain: Chain
    sample: torch.Tensor | tuple[Any, ...]  # the inputs of one microbatch, as build_graph takes them
    batch_norm: tuple[str, ...] = ()  # the model's BatchNorm layers: plans give them the global batch


def sample_size(global_batch: int, num_workers: int) -> int:
    """Samples in the checked (and profiled) microbatch: a replica's share, at most :data:`SAMPLE_MAX`."""
    return max(1, min(SAMPLE_MAX, global_batch // max(1, num_workers)))


def node_bytes(chain: Chain) -> tuple[CellBytes, ...]:
    """Each node's parameter, buffer and trainable bytes (a tensor several nodes hold counts in the first)."""
    seen: set[int] = set()
    out = []
    for node in chain.nodes:
        mine = [t for _, t in chain.stage_tensors(node.index, node.index + 1) if id(t) not in seen]
        seen.update(id(t) for t in mine)
        params = [t for t in mine if isinstance(t, nn.Parameter)]
        buffers = [t for t in mine if not isinstance(t, nn.Parameter)]
        out.append(CellBytes(
            name=node.name, num_params=sum(p.numel() for p in params),
            param_bytes=sum(p.numel() * p.element_size() for p in params),
            buffer_bytes=sum(b.numel() * b.element_size() for b in buffers),
            trainable_bytes=sum(p.numel() * p.element_size() for p in params if p.requires_grad)))
    return tuple(out)


def _on_meta(path: str, kwargs: Mapping[str, Any], seed: int) -> Any | None:
    """The model factory's result built on the meta device (no memory), or None if it does not build there."""
    factory = resolve(path, what="model factory")
    try:
        with torch.device("meta"):
            return seeded(seed, lambda: factory(**kwargs))
    except Exception as exc:  # it may work for real: its own errors are reported from that build
        log.info("model factory %r does not build on the meta device (%s); measuring it built for real",
                 path, first_line(exc))
        return None


def model_structure(config: JobConfig) -> tuple[nn.Module, Chain]:
    """The model and its chain without their values (on the meta device) where the factory allows, else real.

    What maps the stages' tensors to the model's ``state_dict`` keys needs only this: the
    coordinator does not hold a second copy of a large model's parameters to name them.

    Raises:
        JobError: The factory raises or returns something that is not a model torch.fx traces.
    """
    model = config.model
    made = _on_meta(model.factory, model.kwargs, config.data.seed)
    if made is None:
        return build_chain(model.factory, model.kwargs, config.data.seed, model.leaves)
    return unwrapped(made), chain_of(model.factory, made, model.leaves)


def _check_stages(config: JobConfig, made: Any, chain: Chain) -> None:
    """Refuse a plan section that asks for more stages than the model has nodes (cells).

    Raises:
        JobError: Naming the option that asked for stages, the nodes, and how to get more.
    """
    plan, path = config.plan, config.model.factory
    asked: list[tuple[int, str]] = []
    if plan.balance is not None:
        asked.append((len(plan.balance), f"plan.balance={list(plan.balance)}"))
    if plan.num_stages is not None:
        asked.append((plan.num_stages, f"plan.num_stages={plan.num_stages}"))
    if plan.strategy == "pipeline":
        asked.append((2, "plan.strategy='pipeline' (2 or more stages)"))
    for stages, option in asked:
        if stages <= len(chain):
            continue
        names = ", ".join(nd.name for nd in chain.nodes)
        if chain.cells is None:
            raise JobError(
                f"model factory {path!r} returns a {type(made).__name__} that torch.fx traces into "
                f"{len(chain)} node(s) ({names}): it cannot be cut into the {stages} stages {option} asks "
                f"for; ask for at most {len(chain)} stage(s), or give the model as a list of more modules or "
                "cellmesh.Cell(name, module) (docs/models.md)")
        raise JobError(f"model factory {path!r} returns {len(chain)} cell(s) ({names}): it cannot be cut "
                       f"into the {stages} stages {option} asks for; split the model into more cells "
                       f"(cellmesh.Cell) or ask for at most {len(chain)} stage(s)")


def _keeps_no_state(optimizer: torch.optim.Optimizer, param: nn.Parameter) -> bool:
    """Whether ``optimizer`` (over the throwaway ``param``) holds no tensor after a step (plain SGD)."""
    param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return not any(isinstance(v, torch.Tensor) for state in optimizer.state.values() for v in state.values())


def optimizer_keywords(name: str) -> list[str] | None:
    """The keyword arguments ``torch.optim.{name}`` takes besides its parameters, in its signature's order;
    None when it is not an optimizer class or takes any keyword (``**kwargs``)."""
    cls = None if name.startswith("_") else getattr(torch.optim, name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        return None
    try:
        parameters = list(inspect.signature(cls.__init__).parameters.values())[1:]  # after self
    except (TypeError, ValueError):  # no signature to read: torch itself judges the arguments
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in parameters if p.kind in named and p.name != "params"]  # cellmesh passes params


def _check_optimizer_keywords(name: str, kwargs: Mapping[str, Any]) -> None:
    """Refuse a keyword the optimizer does not take, naming it, a close match and the keywords it takes.

    Raises:
        JobError: ``optimizer.kwargs`` has a key ``torch.optim.{name}`` does not take.
    """
    accepted = optimizer_keywords(name)
    if accepted is None:
        return
    unknown = [key for key in kwargs if key not in accepted]
    if not unknown:
        return
    named = []
    for key in unknown:
        close = difflib.get_close_matches(key, accepted, n=1)
        named.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise JobError(f"optimizer.kwargs: {name} takes no keyword {', '.join(named)}; it takes "
                   f"{', '.join(accepted)}; fix optimizer.kwargs")


def check_optimizer(config: JobConfig) -> None:
    """Check 0: build the optimizer and its scheduler as the workers will, over a throwaway parameter, and
    step both once.

    Raises:
        JobError: The optimizer or the scheduler is unknown, unsupported (not elementwise, with
            ``plan.zero`` 1, 2 or 3) or refuses its arguments (an unknown keyword: named with the
            keywords the optimizer takes).
    """
    section = config.optimizer
    if config.plan.zero:  # [Note: elementwise optimizers] in services/params/zero.py
        try:
            check_elementwise(section.name)
        except ValueError as exc:
            raise JobError(f"optimizer: {exc}") from None
    _check_optimizer_keywords(section.name, section.kwargs)
    optimizer_spec = OptimizerSpec(name=section.name, kwargs=dict(section.kwargs))
    param = nn.Parameter(torch.zeros(1))
    try:
        optimizer = make_optimizer(optimizer_spec, [param])
    except ValueError as exc:
        raise JobError(f"optimizer: {exc}; fix optimizer.name or optimizer.kwargs") from None
    if config.plan.zero == 1 and _keeps_no_state(optimizer, param):
        log.warning("plan.zero 1 shards the optimizer's state, but %s with %s keeps none: every step pays "
                    "an all-gather of the parameters for no memory saved; drop plan.zero, or use plan.zero 2 "
                    "or 3 (they shard the gradients and the parameters too)", section.name,
                    dict(section.kwargs))
    if section.scheduler is None:
        return
    spec = SchedulerSpec(name=section.scheduler.name, kwargs=dict(section.scheduler.kwargs))
    try:
        scheduler = scheduling.build_scheduler(spec, optimizer)
        param.grad = torch.zeros_like(param)
        optimizer.step()
        scheduling.step(scheduler)
    except ValueError as exc:
        raise JobError(f"optimizer.scheduler: {exc}; fix optimizer.scheduler.name or "
                       "optimizer.scheduler.kwargs") from None


def batch_norm_of(chain: Chain) -> tuple[str, ...]:
    """The BatchNorm layers of a model's chain, by their qualified names in it."""
    return tuple(batch_norm_layers(chain.module))


def sparse_layers(root: nn.Module) -> list[str]:
    """The layers under ``root`` that make sparse gradients (``nn.Embedding``/``nn.EmbeddingBag`` built
    with ``sparse=True``), as ``"name (Embedding)"`` with the model's names."""
    names = module_names(root)
    return [f"{names[id(m)] or '<root>'} ({type(m).__name__})" for m in root.modules()
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse]


def _measure(config: JobConfig, resources: Resources, optimizer: str, made: Any, chain: Chain) -> None:
    """Checks 1-3 on the model ``made`` (on the meta device or real): stages, memory floor, batch,
    sparse gradients."""
    _check_stages(config, made, chain)
    sparse = sparse_layers(chain.module)
    if sparse:
        raise JobError(f"model factory {config.model.factory!r}: layer {sparse[0]} is built with "
                       "sparse=True, so its gradient is a sparse tensor, which cellmesh's gradient paths "
                       "(data-parallel buckets, ZeRO shards, clipping, the fused optimizers) do not take; "
                       "build it with sparse=False (the same gradient, dense)")
    check_memory_floor(node_bytes(chain), resources, optimizer, config.plan)
    check_batch(config.plan, len(chain), resources.num_workers, config.data.global_batch)
    layers = batch_norm_of(chain)
    batch_norm_request(config.plan, layers)
    if layers and config.optimizer.accumulate > 1:  # each step's run would hold several microbatches
        accumulate = config.optimizer.accumulate
        raise JobError(f"BatchNorm layer {layers[0]} with optimizer.accumulate={accumulate}: "
                       "a stage of a model with BatchNorm runs one microbatch per step, so accumulation is "
                       "not supported for it yet; set optimizer.accumulate to 1 (raise data.global_batch "
                       "instead) or freeze the BatchNorm layers (module.eval())")


def _run_nodes(config: JobConfig, chain: Chain, inputs: Any, targets: Any,
               loss_fn: Callable[[Any, Any], torch.Tensor], section: str = "data") -> Any:
    """Check 6: the sample through the nodes one by one, then the loss, naming the first that fails; the
    model's output. ``section`` names where the sample came from (``"eval"``: the held-out data).

    Raises:
        JobError: A cell (node) does not take what the one before it returns (or the first, the
            data's inputs), or the loss does not take the output and the targets.
    """
    model, loss = config.model.factory, config.loss.factory
    data = config.eval.factory if section == "eval" and config.eval is not None else config.data.factory
    word = "cell" if chain.cells is not None else "node"
    fix = ("make each cell take what the one before it returns (the first cell: the data's inputs)"
           if chain.cells is not None else "make the model take the data's inputs (model(inputs) fails so)")
    value = inputs
    with torch.no_grad(), use_snapshot(chain.module):
        for node in chain.nodes:
            i = node.index
            try:
                value = chain.stage_module(i, i + 1)(value)
            except Exception as exc:
                given = (f"the inputs of {section} factory {data!r}" if i == 0
                         else f"the output of {word} {chain.nodes[i - 1].name!r}")
                leaf = chain.leaf(i)
                kind = ("its operations" if leaf is None else repr(leaf) if "\n" not in repr(leaf)
                        else type(leaf).__name__)
                raise JobError(f"model factory {model!r}: {word} {node.name!r} ({kind}) fails on {given}, "
                               f"{describe_value(value)}: {first_line(exc)}; {fix}") from exc
        try:
            result = loss_fn(value, targets)
        except Exception as exc:
            raise JobError(f"loss factory {loss!r} fails on the model's output, {describe_value(value)}, and "
                           f"the targets of {section} factory {data!r}, {describe_value(targets)}: "
                           f"{first_line(exc)}; make the model's output and the targets fit the "
                           "loss") from exc
    if not isinstance(result, torch.Tensor) or result.numel() != 1:
        raise JobError(f"loss factory {loss!r} returns {describe_value(result)}, not a one-element tensor; "
                       "reduce the loss to a scalar (reduction='mean')")
    return value


def _check_gradients(config: JobConfig, chain: Chain, inputs: Any, targets: Any,
                     loss_fn: Callable[[Any, Any], torch.Tensor]) -> None:
    """Check 6, its second half: the loss's gradients with respect to the trained parameters, on the
    sample, through the whole chain at once (``torch.autograd.grad``: no ``.grad`` is written, and the
    buffers and the random stream are restored after).

    Raises:
        JobError: No parameter requires a gradient, the loss depends on none, the backward raises, or
            a gradient is sparse (or of another layout than a dense tensor's).
    """
    model = config.model.factory
    trained = [(name, p) for name, p in chain.module.named_parameters() if p.requires_grad]
    if not trained:
        raise JobError(f"model factory {model!r}: none of the model's parameters requires a gradient "
                       "(all built or set with requires_grad=False), so a step has nothing to train; "
                       "leave requires_grad=True on the parameters to train")
    with use_snapshot(chain.module):
        loss = loss_fn(chain.stage_module(0, len(chain))(inputs), targets)
        if not loss.requires_grad:
            raise JobError(f"model factory {model!r} with loss factory {config.loss.factory!r}: the loss "
                           "on a sample does not depend on any parameter that requires a gradient (the "
                           "model's output is computed under torch.no_grad() or detached), so a step "
                           "would train nothing; return the output from the parameters' operations")
        try:
            grads = torch.autograd.grad(loss, [p for _, p in trained], allow_unused=True)
        except Exception as exc:
            raise JobError(f"model factory {model!r}: the backward of the loss on a sample fails: "
                           f"{first_line(exc)}; make every operation between the parameters and the "
                           "loss differentiable") from exc
    for (name, _), grad in zip(trained, grads, strict=True):
        if grad is not None and grad.layout != torch.strided:
            raise JobError(f"model factory {model!r}: parameter {name!r} gets a {grad.layout} gradient "
                           "(an embedding looked up with sparse=True, e.g. F.embedding(..., sparse=True)), "
                           "which cellmesh's gradient paths (data-parallel buckets, ZeRO shards, clipping, "
                           "the fused optimizers) do not take; look it up with sparse=False (the same "
                           "gradient, dense)")


def _load(source: SampleSource, path: str, section: str, indices: list[int]) -> tuple[Any, Any]:
    """Check 5: ``source`` loads the sample ``indices`` (the factory ``path`` of ``section``).

    Raises:
        JobError: The samples are inconsistent, or loading them raised.
    """
    try:
        return source.load(indices)
    except SampleError as exc:
        raise JobError(str(exc)) from None
    except Exception as exc:
        raise JobError(f"{section} factory {path!r}: loading samples {indices} raised {located(exc)}; fix "
                       "its load(indices)") from exc


def _check_eval(config: JobConfig, chain: Chain, loss_fn: Callable[[Any, Any], torch.Tensor],
                size: int) -> None:
    """Check 7: the held-out data, a sample of ``size`` through the nodes in eval mode, the loss, the metric.

    Raises:
        JobError: Naming the eval factory or the metric, and the fix.
    """
    section = config.eval
    assert section is not None
    source = build_data(section.factory, section.kwargs, config.data.seed, section="eval")
    n = section.num_samples or source.num_samples
    if n is None:
        raise JobError(f"eval factory {section.factory!r} returns a loader: give eval.num_samples")
    if source.num_samples is not None and n > source.num_samples:
        raise JobError(f"eval.num_samples={n} but eval factory {section.factory!r} returns "
                       f"{source.num_samples} samples: lower eval.num_samples or leave it out")
    metric_fn = build_metric(section.metric) if section.metric else None
    inputs, targets = _load(source, section.factory, "eval", list(range(min(size, n))))
    with evaluating(chain.module):
        output = _run_nodes(config, chain, inputs, targets, loss_fn, section="eval")
        if metric_fn is not None:
            try:
                with torch.no_grad():
                    metric_sum(metric_fn(output, targets), min(size, n), what="the metric")
            except Exception as exc:
                raise JobError(f"eval metric factory {section.metric!r}: on the model's output, "
                               f"{describe_value(output)}, and the targets of eval factory "
                               f"{section.factory!r}, {describe_value(targets)}: {first_line(exc)}") from exc


def _untraced_draw(chain: Chain, record: list[Drawn]) -> str | None:
    """The module of the first draw made in code torch.fx traced into (outside every node's leaf module).

    A stage runs such code inlined into its own graph module, so it would key the draw by the stage
    rather than by the module one process sees drawing it: the draws would differ from one process's.
    None when every draw is made inside a leaf (a cell, a ``torch.nn`` module, a block of a stack, a
    module of ``model.leaves``) -- always so for a sequence of cells.
    """
    if chain.cells is not None:
        return None
    leaves = [str(nd.target) for nd in chain.module.graph.nodes if nd.op == "call_module"]
    for drawn in record:
        if not any(drawn.module == leaf or drawn.module.startswith(f"{leaf}.") for leaf in leaves):
            return drawn.module
    return None


def _check_draws(config: JobConfig, root: nn.Module, source: SampleSource, chain: Chain) -> None:
    """Check 8: the draws of forwards on 2 and 3 samples are keyed so that every plan draws alike.

    Skipped when the model draws nothing, the data holds fewer than 3 samples, or the model
    does not run on 2 or 3 samples (its own checks are the sample's, check 6).

    Raises:
        JobError: A draw's size follows the batch elsewhere than along dim 0, or a draw is made in
            code torch.fx traces into (naming the module and the fix).
    """
    if (source.num_samples or config.data.num_samples or 0) < 3:
        return
    randomness = ModelRandomness(root, config.data.seed)
    records: list[list[Drawn]] = []
    for size in (2, 3):
        record: list[Drawn] = []
        try:
            inputs, _ = source.load(list(range(size)))
            with torch.no_grad(), use_snapshot(root), randomness.forward(0, list(range(size)), record):
                call_model(root, inputs)
        except Exception as exc:
            log.info("the random draws were not checked: the model does not run on %d samples (%s)", size,
                     first_line(exc))
            return
        if not record:
            return
        untraced = _untraced_draw(chain, record)
        if untraced is not None:
            where = (f"submodule {untraced!r}" if untraced else "the model's own forward")
            leaf = untraced
            if untraced:  # a class that recurs (a block's attention): its name stands for all of them
                kind = type(root.get_submodule(untraced)).__name__
                if sum(type(m).__name__ == kind for m in root.modules()) > 1:
                    leaf = kind
            fix = (f"list it in model.leaves (model: {{leaves: [{leaf}]}}, Job(leaves=[{leaf!r}])) "
                   "so it runs as one node, or draw through an nn.Dropout module" if untraced else
                   "draw through a submodule (nn.Dropout) instead of a function in the forward")
            raise JobError(f"model factory {config.model.factory!r}: {where} draws random numbers (dropout) "
                           "in code torch.fx traces into, so a pipeline stage would key the draws by the "
                           f"stage, not by the module, and train differently from one process; {fix}")
        records.append(record)
    problem = check_draws(records[0], records[1], (2, 3))
    if problem is not None:
        raise JobError(f"model factory {config.model.factory!r}: {problem}")


def check_enough_samples(config: JobConfig, num_samples: int | None) -> None:
    """Refuse data of fewer samples than one global batch (a step could not be drawn).

    Raises:
        JobError: Naming the data factory, its sample count and ``data.global_batch``.
    """
    batch = config.data.global_batch
    if num_samples is not None and num_samples < batch:
        raise JobError(f"data factory {config.data.factory!r} gives {num_samples} samples, fewer than one "
                       f"global batch (data.global_batch={batch}): lower data.global_batch to at most "
                       f"{num_samples} or give more samples")


def _check_num_samples(config: JobConfig, source: SampleSource) -> None:
    """Check 5's count: the samples are known, there are as many as ``data.num_samples`` says (tensors:
    a loader's are its own business) and at least one global batch.

    Raises:
        JobError: Naming the data factory, the field and the fix.
    """
    data = config.data
    given, held = data.num_samples, source.num_samples
    if given is None and held is None:
        raise JobError(f"data factory {data.factory!r} returns a loader: give data.num_samples "
                       "(Job(num_samples=...))")
    if given is not None and held is not None and given > held:
        raise JobError(f"data.num_samples={given} but data factory {data.factory!r} returns {held} samples: "
                       "lower data.num_samples or leave it out")
    check_enough_samples(config, given or held)


def check_job(config: JobConfig, resources: Resources, optimizer: str) -> Checked:
    """Run every check of the module docstring on ``config`` for ``resources``; keep what they built.

    Args:
        config: The job's config.
        resources: The workers it will run on (their count and memory).
        optimizer: The optimizer's kind (a key of ``OPTIMIZER_STATE_FACTORS``): its state's size.

    Raises:
        JobError: The optimizer or its scheduler refuses its arguments, a factory raises or returns
            something unusable, the data is inconsistent (or holds less than one global batch), a node
            or the loss fails on the sample,
            the loss's gradients on it are unusable, or the plan asks for more stages than nodes.
        coordinator.planning.request.PlanningError: No plan can hold the model, the global batch
            does not split into the fixed replicas or microbatches, or the fixed microbatches or
            mode would not give a BatchNorm layer the global batch.
        ValueError: A factory does not import.
    """
    check_optimizer(config)
    model, data = config.model, config.data
    on_meta = _on_meta(model.factory, model.kwargs, data.seed)
    measured = on_meta is not None
    if on_meta is not None:
        _measure(config, resources, optimizer, on_meta, chain_of(model.factory, on_meta, model.leaves))
    on_meta = None  # nothing of the meta model is kept
    built, chain = build_chain(model.factory, model.kwargs, data.seed, model.leaves)
    if not measured:  # measured built for real: still before any profiling
        _measure(config, resources, optimizer, built, chain)
    source = build_data(data.factory, data.kwargs, data.seed)
    _check_num_samples(config, source)
    loss_fn = build_loss(config.loss.factory, config.loss.kwargs)
    size = sample_size(data.global_batch, resources.num_workers)
    indices = list(range(min(size, source.num_samples or data.num_samples or SAMPLE_MAX)))
    inputs, targets = _load(source, data.factory, "data", indices)
    _run_nodes(config, chain, inputs, targets, loss_fn)
    _check_gradients(config, chain, inputs, targets, loss_fn)
    if config.eval is not None:
        _check_eval(config, chain, loss_fn, size)
    _check_draws(config, unwrapped(built), source, chain)
    sample = inputs if isinstance(inputs, torch.Tensor) else (inputs,)
    return Checked(chain=chain, sample=sample, batch_norm=batch_norm_of(chain))
