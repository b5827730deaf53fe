"""The Python API: ``Job(config)`` or ``Job(model=..., loss=..., data=...)``, ``plan()``, ``fit()``.

A job is its config (:class:`~coordinator.planning.config.JobConfig`), given whole or as flat
keyword fields, one per config field: a section's factory or name is the section's name
(``model=``, ``optimizer=``); its arguments, and every field of the ``checkpoint`` and
``logging`` sections (whose names are vague alone), are ``<section>_<field>``
(``model_kwargs=``, ``logging_level=``, ``logging_run_dir=``, ``checkpoint_keep=``); any
other field is its own name wherever it sits (``global_batch`` is ``data.global_batch``,
``num_stages`` is ``plan.num_stages``, ``workers`` is ``runtime.workers``).
:data:`~coordinator.planning.config.FLAT_KEYS` lists them all. A job names its model, data
and loss by importable factories (``coordinator/runtime/factories.py``), so the workers build
them themselves. ``plan()`` builds the model in this process, traces and profiles it on a
sample microbatch and asks the planner (``coordinator/planning/planner.py``) with the config's
plan section. ``fit(steps)`` runs the plan on the embedded
local harness (``Resources`` describe local worker processes for now) and returns the loss
history, the event log of every step and the final parameters as a plain ``state_dict``
of the unwrapped model (:meth:`Job.build_model`; it loads with ``strict=True``).

Sessions. Outside a ``with job:`` block each ``fit`` starts the workers, trains from the
factory's initial parameters and tears everything down. Inside one, the workers stay up
and successive ``fit`` calls continue training (steps and samples carry on).
``with job.attach(pool):`` runs the session on workers that are already up (a test
fixture's harness shared by many jobs, or a cluster's pods:
:class:`~coordinator.runtime.cluster.ClusterWorkers`): the job's services are released at the
end, the workers stay.

[Note: what the invariant compares]
``coordinator/runtime/reference.py`` trains one process on the same global batches (the
sampler's, in order) with the same optimizer: every plan must end at its parameters, to
float64 rounding.
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch import nn

from coordinator.planning.config import JobConfig, from_flat
from coordinator.planning.data import BatchSampler, split_batch
from coordinator.planning.graph import build_graph
from coordinator.planning.plan import Plan
from coordinator.planning.planner import choose_plan
from coordinator.planning.profile import OPTIMIZER_STATE_FACTORS, profile_graph
from coordinator.planning.request import batch_note
from coordinator.planning.resources import Resources
from coordinator.runtime.cluster import WorkerPool
from coordinator.runtime.driver import RunSpec, Runtime
from coordinator.runtime.factories import build_cells, build_data, factory_path, job_factories
from coordinator.runtime.harness import LocalHarness
from coordinator.runtime.loop import EventLoop
from coordinator.runtime.preflight import Checked, check_job, model_structure
from coordinator.runtime.records import StepRecord
from services.compute.cell import Cell, cell_parameters
from services.protocol import OptimizerSpec

__all__ = ["FitResult", "Job", "StepCallback", "optimizer_spec", "state_dict_of"]

log = logging.getLogger(__name__)

StepCallback = Callable[[StepRecord], None]
_runs = itertools.count()
_PROCESS_TAG = uuid.uuid4().hex[:4]
OptimizerRef = str | type[torch.optim.Optimizer]


@dataclass
class FitResult:
    """What ``fit`` returns: per-step losses, the final ``state_dict``, every step's record, the plan."""

    losses: list[float]
    state_dict: dict[str, torch.Tensor]
    steps: list[StepRecord] = field(default_factory=list)
    plan: Plan | None = None


def optimizer_spec(optimizer: OptimizerRef, kwargs: dict[str, Any]) -> OptimizerSpec:
    """A ``torch.optim`` class (or its name) and its arguments, as the services take them.

    Raises:
        ValueError: Not a ``torch.optim`` optimizer class.
    """
    name = optimizer if isinstance(optimizer, str) else optimizer.__name__
    cls = getattr(torch.optim, name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)) or (
            not isinstance(optimizer, str) and cls is not optimizer):
        raise ValueError(f"optimizer {optimizer!r} is not a torch.optim optimizer class")
    clean = {k: list(v) if isinstance(v, tuple) else v for k, v in kwargs.items()}
    return OptimizerSpec(name=name, kwargs=clean)


def _named(fields: dict[str, Any]) -> dict[str, Any]:
    """``Job``'s keyword fields with factory functions as their names and an optimizer class as its name.

    Raises:
        ValueError: A function is not importable by name, or a class is not ``torch.optim``'s.
    """
    named = dict(fields)
    for key in ("model", "data", "loss"):
        if callable(named.get(key)):
            named[key] = factory_path(named[key], what=f"{key} factory")
    if isinstance(named.get("optimizer"), type):
        named["optimizer"] = optimizer_spec(named["optimizer"], {}).name
    return named


def state_dict_of(model: nn.Module, cells: list[Cell],
                  cell_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``cell_state`` (cell-qualified names) keyed as ``model.state_dict()`` names ``cells``' tensors.

    The values are ``cell_state``'s own tensors (not copies): a parameter tied under two keys
    is one tensor under both, as in ``model.state_dict()``. ``model`` may be on the meta device.

    Raises:
        KeyError: An entry of the model's state has no cell-qualified counterpart.
    """
    by_id: dict[int, str] = {id(p): n for n, p in cell_parameters(cells)}
    for cell in cells:
        for name, buf in cell.module.named_buffers():
            by_id.setdefault(id(buf), f"{cell.name}.{name}")
    out: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        qualified = by_id.get(id(value))
        if qualified is None or qualified not in cell_state:
            raise KeyError(f"state entry {key!r} of the model was not returned by any stage")
        out[key] = cell_state[qualified].detach()
    return out


def _optimizer_kind(spec: OptimizerSpec) -> str:
    name = spec.name.lower()
    if name == "sgd":
        return "momentum" if spec.kwargs.get("momentum") else "sgd"
    return name if name in OPTIMIZER_STATE_FACTORS else "adam"


class Job:
    """A training job: its config, the workers it runs on, and its training session.

    Args:
        config: The job's config; or give its fields as keywords instead (not both).

    Keyword Args:
        resources: The workers; default ``Resources.local(config.runtime.workers)``. Given, they
            replace the local workers the config describes (a cluster's, a custom description).
        plan: A complete plan to use as is (the config's plan section is then not consulted).
        log_dir: Where the local workers' output goes (``{worker}.log``); None: a temporary
            directory, kept only when a worker failed (``coordinator/runtime/harness.py``).
        **fields: The config's fields by their flat names (see the module docstring): ``model``,
            ``data``, ``loss`` as ``"package.module:function"`` or a module-level function,
            ``optimizer`` as a ``torch.optim`` class or its name, ``global_batch``,
            ``num_stages``, ``workers``, ``step_timeout_s``, ``logging_format``,
            ``checkpoint_directory``...

    Raises:
        ValueError: The fields are invalid (a ``ConfigError`` naming each bad key), a factory
            cannot be imported by name, or the optimizer is not a ``torch.optim`` class.
        TypeError: Both a config and keyword fields were given.
    """

    def __init__(self, config: JobConfig | None = None, /, *, resources: Resources | None = None,
                 plan: Plan | None = None, log_dir: Path | None = None, **fields: Any) -> None:
        if config is None:
            config = from_flat(_named(fields))
        elif fields:
            raise TypeError(f"Job() takes a JobConfig or keyword fields, not both (got {sorted(fields)})")
        for section, what in ((config.model, "model"), (config.data, "data"), (config.loss, "loss")):
            factory_path(section.factory, what=f"{what} factory", code_dir=config.runtime.code_dir)
        self.config = config
        self.optimizer = optimizer_spec(config.optimizer.name, dict(config.optimizer.kwargs))
        self.resources = resources or Resources.local(workers=config.runtime.workers)
        self.name = config.name or f"job-{uuid.uuid4().hex[:8]}"
        self.fixed_plan = plan
        self.log_dir = log_dir
        self._plan = plan
        self._checked: Checked | None = None
        self._session: _Session | None = None
        self.steps_done = 0

    # -- building and planning ------------------------------------------------------------

    def build_model(self) -> nn.Module:
        """The unwrapped model with its initial parameters (the module ``fit``'s state_dict loads into)."""
        model = self.config.model
        return build_cells(model.factory, model.kwargs, self.config.data.seed)[0]

    def sampler(self) -> BatchSampler:
        """The global batches of every step (see ``coordinator/planning/data.py``).

        Raises:
            ValueError: The data's size is unknown (give ``data.num_samples``) or below the global batch.
        """
        data = self.config.data
        n = data.num_samples or build_data(data.factory, data.kwargs, data.seed).num_samples
        if n is None:
            raise ValueError(f"data factory {data.factory!r} returns a loader: give data.num_samples "
                             "(Job(num_samples=...))")
        return BatchSampler(n, data.global_batch, shuffle=data.shuffle, seed=data.seed)

    def check(self) -> Checked:
        """Check the job before any worker starts (``coordinator/runtime/preflight.py``), for :meth:`plan`.

        Raises:
            coordinator.runtime.errors.JobError: A factory raises, the data is inconsistent, a cell
                or the loss fails on a sample, or the plan asks for more stages than the model has cells.
            coordinator.planning.request.PlanningError: No plan can hold the model, or the global
                batch does not split into the fixed replicas or microbatches.
        """
        if self._checked is None:
            self._checked = check_job(self.config, self.resources, _optimizer_kind(self.optimizer))
        return self._checked

    def plan(self) -> Plan:
        """The plan (computed once): the plan section's fixed fields as given, the rest chosen by the planner.

        The job is checked first (:meth:`check`). When the global batch keeps the planner from
        using every worker, a warning says so and what batch would (``batch_note``).

        Raises:
            coordinator.planning.request.PlanningError: No plan satisfies the fixed fields and the resources.
            coordinator.runtime.errors.JobError: The job fails a check (see :meth:`check`).
            ValueError: The model is not a sequence of cells the services can run.
        """
        if self._plan is None:
            config, checked = self.config, self.check()
            graph = build_graph(checked.cells, checked.sample)
            if [nd.name for nd in graph.nodes] != [c.name for c in checked.cells]:
                raise ValueError(f"the model's graph has nodes {[nd.name for nd in graph.nodes]}, not one "
                                 f"per cell {[c.name for c in checked.cells]}: give the model as a sequence "
                                 "of cells")
            profile = profile_graph(graph, checked.sample, repeats=3,
                                    optimizer=_optimizer_kind(self.optimizer), num_threads=1)
            self._plan = choose_plan(profile, self.resources, config.plan,
                                     global_batch=config.data.global_batch)
            self._checked = None  # the model built for the checks is not needed any more
            note = batch_note(self._plan.data_parallel, self._plan.num_stages, config.plan,
                              self.resources.num_workers, config.data.global_batch)
            if note is not None:
                log.warning("%s", note)
        return self._plan

    def run_spec(self, workers_job: str, run: str) -> RunSpec:
        """What the runtime builds services from; ``workers_job`` is the workers' registry prefix."""
        c = self.config
        return RunSpec(job=workers_job, run=run, model=c.model.factory, data=c.data.factory,
                       loss=c.loss.factory, optimizer=self.optimizer, model_kwargs=c.model.kwargs,
                       data_kwargs=c.data.kwargs, loss_kwargs=c.loss.kwargs, seed=c.data.seed,
                       comm_backend=c.runtime.comm_backend, nonfinite=c.runtime.nonfinite,
                       step_timeout=timedelta(seconds=c.runtime.step_timeout_s))

    # -- training -------------------------------------------------------------------------

    def __enter__(self) -> Job:
        self._session = _Session(self, None).start()
        return self

    @contextmanager
    def attach(self, pool: WorkerPool) -> Iterator[Job]:
        """A session on ``pool``'s running workers (which must include the resources' workers)."""
        self._session = _Session(self, pool).start()
        try:
            yield self
        finally:
            self.__exit__(None, None, None)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        session, self._session = self._session, None
        if session is not None:
            session.close()

    @property
    def harness(self) -> LocalHarness | None:
        """The running local harness inside ``with job:`` (fault-injection tests use it)."""
        pool = self._session.harness if self._session is not None else None
        return pool if isinstance(pool, LocalHarness) else None

    def fit(self, steps: int | None = None, *, callback: StepCallback | None = None) -> FitResult:
        """Train ``steps`` steps (default: the config's ``steps``); return the losses, the final
        state_dict and the step records.

        Raises:
            coordinator.runtime.driver.JobFailed: A worker failed or vanished (names worker, service, step).
            coordinator.planning.request.PlanningError: No plan fits.
        """
        steps = self.config.steps if steps is None else steps
        if steps < 0:
            raise ValueError(f"steps must be >= 0, got {steps}")
        if self._session is None:
            with self:
                return self._fit(steps, callback)
        return self._fit(steps, callback)

    def _fit(self, steps: int, callback: StepCallback | None) -> FitResult:
        session = self._session
        if session is None:
            raise RuntimeError("the job's session is closed")
        return session.fit(steps, callback)


class _Session:
    """The harness, event loop and runtime of one ``with job:`` block."""

    def __init__(self, job: Job, pool: WorkerPool | None) -> None:
        self.job = job
        self.plan = job.plan()
        self.sampler = job.sampler()
        names = [w.name for w in job.resources.workers]
        self.local: LocalHarness | None = None  # the harness this session starts and stops itself
        if pool is None:
            threads = max(1, min(w.cpus for w in job.resources.workers))
            runtime = job.config.runtime
            code_dir = [runtime.code_dir] if runtime.code_dir is not None else []
            lease_ttl = timedelta(seconds=runtime.lease_ttl_s)
            pool = self.local = LocalHarness(names, job=job.name, lease_ttl=lease_ttl, threads=threads,
                                             python_path=code_dir, log_dir=job.log_dir,
                                             factories=job_factories(job.config))
        self.harness: WorkerPool = pool
        missing = sorted({w for r in self.plan.placement for w in r}
                         - set(self.harness.names))
        if missing:
            raise ValueError(f"the plan places stages on workers {missing} the harness does not run "
                             f"({self.harness.names})")
        self.loop: EventLoop | None = None
        self.runtime: Runtime | None = None

    def start(self) -> _Session:
        job = self.job
        job.steps_done = 0  # a new session trains from the initial parameters and the first batch
        try:
            started = time.monotonic()
            if self.local is not None:
                self.local.start()
            self.loop = EventLoop(self.harness.registry, self.harness.job).start()
            initial: dict[str, torch.Tensor] = {}
            if self.plan.mode == "parameter_server":  # the shards start from the coordinator's copy
                model = job.config.model
                _, cells = build_cells(model.factory, model.kwargs, job.config.data.seed)
                initial = {n: p.detach() for n, p in cell_parameters(cells)}
            addresses = {n: self.harness.address(n) for n in self.harness.names}
            # unique per coordinator process too: a restarted coordinator never meets its predecessor's names
            spec = job.run_spec(self.harness.job, f"{job.name}-{_PROCESS_TAG}{next(_runs)}")
            self.runtime = Runtime(self.plan, spec, self.loop, self.harness.registry_url, addresses, initial)
            self.runtime.place()
            log.info("[coordinator %s] up in %.1fs", job.name, time.monotonic() - started)
        except BaseException:
            self.close()
            raise
        return self

    def fit(self, steps: int, callback: StepCallback | None) -> FitResult:
        assert self.runtime is not None
        plan, records = self.plan, []
        for _ in range(steps):
            k = self.job.steps_done
            batches = split_batch(self.sampler.indices(k), plan.data_parallel, plan.num_microbatches)
            record = self.runtime.run_step(k, batches)
            self.job.steps_done += 1
            records.append(record)
            if callback is not None:
                callback(record)
        model, cells = model_structure(self.job.config)  # names only: the values are the stages'
        state = state_dict_of(model, cells, self.runtime.state())
        return FitResult(losses=[r.loss for r in records], state_dict=state, steps=records, plan=plan)

    def close(self) -> None:
        if self.runtime is not None and self.local is None:
            self.runtime.close()
        if self.loop is not None:
            self.loop.close()
        if self.local is not None:
            self.local.close()
