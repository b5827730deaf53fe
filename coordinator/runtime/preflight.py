"""The checks a job passes in the coordinator's process before any worker starts.

Each turns a mistake a new user makes into one line naming the cause and the fix, seconds
after the job is loaded, instead of a traceback, minutes of planning, or silently wrong
training. :func:`check_job` runs them in order, cheapest first:

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
   (``coordinator/planning/request.py``);
4. the model built for real: a factory that raises is named with the line of the user's
   code that raised (``coordinator/runtime/factories.py``);
5. the data: inputs and targets of one length (``SampleSource``), and a sample microbatch
   loads;
6. the sample through the nodes one by one (each node's stage module), then the loss: the
   first cell or node that fails is named with what it was given (``cell 'cell2' fails on the
   output of cell 'cell1', a [8, 12] float32 tensor: mat1 and mat2 shapes cannot be
   multiplied``), as is a loss that does not take the model's output and the targets.

Failures are :class:`~coordinator.runtime.errors.JobError` (or ``PlanningError`` for a model
no plan holds); ``cellmesh run`` prints them as one line and exits 2. What passed is kept
for planning (:class:`Checked`): the built model's chain and the sample.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from coordinator.planning.config import JobConfig
from coordinator.planning.graph import describe_value, use_snapshot
from coordinator.planning.planner import CellBytes, check_memory_floor
from coordinator.planning.request import check_batch
from coordinator.planning.resources import Resources
from coordinator.runtime.errors import JobError, first_line, located
from coordinator.runtime.factories import build_chain, build_data, build_loss, chain_of, seeded, unwrapped
from services.compute.chain import Chain
from services.compute.stage import SampleError
from services.factories import resolve

__all__ = ["Checked", "check_job", "model_structure", "node_bytes", "sample_size"]

log = logging.getLogger(__name__)

SAMPLE_MAX = 8  # samples in the microbatch the checks (and the profile) run


@dataclass
class Checked:
    """What passed :func:`check_job`: the model's chain of nodes with its initial parameters, and a sample."""

    chain: Chain
    sample: torch.Tensor | tuple[Any, ...]  # the inputs of one microbatch, as build_graph takes them


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


def _measure(config: JobConfig, resources: Resources, optimizer: str, made: Any, chain: Chain) -> None:
    """Checks 1-3 on the model ``made`` (on the meta device or real): stages, memory floor, batch."""
    _check_stages(config, made, chain)
    check_memory_floor(node_bytes(chain), resources, optimizer)
    check_batch(config.plan, len(chain), resources.num_workers, config.data.global_batch)


def _run_nodes(config: JobConfig, chain: Chain, inputs: Any, targets: Any,
               loss_fn: Callable[[Any, Any], torch.Tensor]) -> None:
    """Check 6: the sample through the nodes one by one, then the loss, naming the first that fails.

    Raises:
        JobError: A cell (node) does not take what the one before it returns (or the first, the
            data's inputs), or the loss does not take the output and the targets.
    """
    model, data, loss = config.model.factory, config.data.factory, config.loss.factory
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
                given = (f"the inputs of data factory {data!r}" if i == 0
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
                           f"the targets of data factory {data!r}, {describe_value(targets)}: "
                           f"{first_line(exc)}; make the model's output and the targets fit the "
                           "loss") from exc
    if not isinstance(result, torch.Tensor) or result.numel() != 1:
        raise JobError(f"loss factory {loss!r} returns {describe_value(result)}, not a one-element tensor; "
                       "reduce the loss to a scalar (reduction='mean')")


def check_job(config: JobConfig, resources: Resources, optimizer: str) -> Checked:
    """Run every check of the module docstring on ``config`` for ``resources``; keep what they built.

    Args:
        config: The job's config.
        resources: The workers it will run on (their count and memory).
        optimizer: The optimizer's kind (a key of ``OPTIMIZER_STATE_FACTORS``): its state's size.

    Raises:
        JobError: A factory raises or returns something unusable, the data is inconsistent,
            a node or the loss fails on the sample, or the plan asks for more stages than nodes.
        coordinator.planning.request.PlanningError: No plan can hold the model, or the global
            batch does not split into the fixed replicas or microbatches.
        ValueError: A factory does not import.
    """
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
    loss_fn = build_loss(config.loss.factory, config.loss.kwargs)
    indices = list(range(min(sample_size(data.global_batch, resources.num_workers),
                             source.num_samples or data.num_samples or SAMPLE_MAX)))
    try:
        inputs, targets = source.load(indices)
    except SampleError as exc:
        raise JobError(str(exc)) from None
    except Exception as exc:
        raise JobError(f"data factory {data.factory!r}: loading samples {indices} raised {located(exc)}; fix "
                       "its load(indices)") from exc
    _run_nodes(config, chain, inputs, targets, loss_fn)
    sample = inputs if isinstance(inputs, torch.Tensor) else (inputs,)
    return Checked(chain=chain, sample=sample)
