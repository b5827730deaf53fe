"""The Python API: ``Job(model, loss, optimizer, data, resources, strategy=...)``, ``plan()``, ``fit()``.

A job names its model, data and loss by importable factories (``coordinator/runtime/factories.py``),
so the workers build them themselves. ``plan()`` builds the model in this process, traces
and profiles it on a sample microbatch and asks the planner (``coordinator/planning/planner.py``);
every plan field may be fixed by keyword. ``fit(steps)`` runs the plan on the embedded
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

from coordinator.planning.data import BatchSampler, split_batch
from coordinator.planning.graph import build_graph
from coordinator.planning.plan import Mode, Plan
from coordinator.planning.planner import Strategy, choose_plan
from coordinator.planning.profile import OPTIMIZER_STATE_FACTORS, profile_graph
from coordinator.planning.resources import Resources
from coordinator.runtime.cluster import WorkerPool
from coordinator.runtime.driver import RunSpec, Runtime, StepRecord
from coordinator.runtime.factories import FactoryRef, build_cells, build_data, factory_path
from coordinator.runtime.harness import DEFAULT_LEASE_TTL, LocalHarness
from coordinator.runtime.loop import EventLoop
from services.compute.cell import Cell, cell_parameters
from services.protocol import FactoryKwargs, OptimizerSpec

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


def state_dict_of(model: nn.Module, cells: list[Cell],
                  cell_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``cell_state`` (cell-qualified names) keyed as ``model.state_dict()`` (sharing ``cells``' tensors).

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
        out[key] = cell_state[qualified].detach().clone()
    return out


def _optimizer_kind(spec: OptimizerSpec) -> str:
    name = spec.name.lower()
    if name == "sgd":
        return "momentum" if spec.kwargs.get("momentum") else "sgd"
    return name if name in OPTIMIZER_STATE_FACTORS else "adam"


class Job:
    """A training job: model, loss, optimizer, data, resources and the plan fields to fix.

    Args:
        model: Factory of the model: a sequence of modules or Cells (cut between cells).
        loss: Factory of ``loss(output, targets) -> scalar`` (a loss class works: ``torch.nn:MSELoss``).
        data: Factory of the samples: ``(inputs, targets)`` along dim 0, or a ``load(indices)`` callable.
        optimizer: A ``torch.optim`` class or its name.
        optimizer_kwargs: Its arguments (``lr``...).
        resources: Default ``Resources.local(workers=2)``.
        global_batch: Samples per step over all replicas.

    Keyword Args:
        strategy: ``"auto"``, ``"data_parallel"`` or ``"pipeline"``.
        data_parallel, num_stages, mode, schedule, num_microbatches, balance: Fix plan fields
            (see ``coordinator.planning.planner.choose_plan``).
        plan: A complete plan to use as is.
        model_kwargs, data_kwargs, loss_kwargs: Keyword arguments of the factories.
        seed: Seeds the model and data factories (every worker uses the same).
        shuffle: Permute the samples each epoch.
        num_samples: How many samples a ``load`` callable serves (needed only for such data).
        name: The job's name (registry prefix); a unique one by default.
        comm_backend: ``"zmq"`` or ``"gloo"``.
        step_timeout: Bounds each round of a step (run, commit).
        lease_ttl: A dead worker is noticed at most this long after it stopped.
        log_dir: Where the local workers' output goes (``{worker}.log``); None: a temporary
            directory, kept only when a worker failed (``coordinator/runtime/harness.py``).

    Raises:
        ValueError: A factory cannot be imported by name, or the optimizer is unknown.
    """

    def __init__(self, *, model: FactoryRef, loss: FactoryRef, data: FactoryRef,
                 optimizer: OptimizerRef = "SGD", optimizer_kwargs: dict[str, Any] | None = None,
                 resources: Resources | None = None,
                 global_batch: int = 32, strategy: Strategy = "auto", data_parallel: int | None = None,
                 num_stages: int | None = None, mode: Mode | None = None, schedule: str | None = None,
                 num_microbatches: int | None = None, balance: list[int] | None = None,
                 plan: Plan | None = None,
                 model_kwargs: FactoryKwargs | None = None, data_kwargs: FactoryKwargs | None = None,
                 loss_kwargs: FactoryKwargs | None = None, seed: int = 0, shuffle: bool = True,
                 num_samples: int | None = None, name: str | None = None, comm_backend: str = "zmq",
                 step_timeout: timedelta = timedelta(seconds=300),
                 lease_ttl: timedelta = DEFAULT_LEASE_TTL, log_dir: Path | None = None) -> None:
        self.model = factory_path(model, what="model factory")
        self.loss = factory_path(loss, what="loss factory")
        self.data = factory_path(data, what="data factory")
        self.optimizer = optimizer_spec(optimizer, dict(optimizer_kwargs or {"lr": 0.01}))
        self.resources = resources or Resources.local(workers=2)
        self.global_batch = global_batch
        self.plan_fields: dict[str, Any] = dict(strategy=strategy, data_parallel=data_parallel,
                                                num_stages=num_stages, mode=mode, schedule=schedule,
                                                num_microbatches=num_microbatches, balance=balance)
        self.model_kwargs = dict(model_kwargs or {})
        self.data_kwargs = dict(data_kwargs or {})
        self.loss_kwargs = dict(loss_kwargs or {})
        self.seed = seed
        self.shuffle = shuffle
        self.name = name or f"job-{uuid.uuid4().hex[:8]}"
        self.comm_backend = comm_backend
        self.step_timeout = step_timeout
        self.lease_ttl = lease_ttl
        self.log_dir = log_dir
        self._plan = plan
        self._num_samples = num_samples
        self._session: _Session | None = None
        self.steps_done = 0

    # -- building and planning ------------------------------------------------------------

    def build_model(self) -> nn.Module:
        """The unwrapped model with its initial parameters (the module ``fit``'s state_dict loads into)."""
        return build_cells(self.model, self.model_kwargs, self.seed)[0]

    def sampler(self) -> BatchSampler:
        """The global batches of every step (see ``coordinator/planning/data.py``).

        Raises:
            ValueError: The data's size is unknown (pass ``num_samples``) or below the global batch.
        """
        n = self._num_samples or build_data(self.data, self.data_kwargs, self.seed).num_samples
        if n is None:
            raise ValueError(f"data factory {self.data!r} returns a loader: pass Job(num_samples=...)")
        return BatchSampler(n, self.global_batch, shuffle=self.shuffle, seed=self.seed)

    def plan(self) -> Plan:
        """The plan (computed once): fixed fields as given, the rest chosen by the planner.

        Raises:
            coordinator.planning.planner.PlanningError: No plan satisfies the fixed fields and the resources.
            ValueError: The model is not a sequence of cells the services can run.
        """
        if self._plan is None:
            _, cells = build_cells(self.model, self.model_kwargs, self.seed)
            source = build_data(self.data, self.data_kwargs, self.seed)
            size = max(1, min(8, self.global_batch // max(1, self.resources.num_workers)))
            inputs, _ = source.load(list(range(size)))
            sample = inputs if isinstance(inputs, torch.Tensor) else (inputs,)
            graph = build_graph(cells, sample)
            if [nd.name for nd in graph.nodes] != [c.name for c in cells]:
                raise ValueError(f"the model's graph has nodes {[nd.name for nd in graph.nodes]}, not one "
                                 f"per cell {[c.name for c in cells]}: give the model as a sequence of cells")
            profile = profile_graph(graph, sample, repeats=3, optimizer=_optimizer_kind(self.optimizer),
                                    num_threads=1)
            self._plan = choose_plan(profile, self.resources, global_batch=self.global_batch,
                                     **self.plan_fields)
        return self._plan

    def run_spec(self, workers_job: str, run: str) -> RunSpec:
        """What the runtime builds services from; ``workers_job`` is the workers' registry prefix."""
        return RunSpec(job=workers_job, run=run, model=self.model, data=self.data, loss=self.loss,
                       optimizer=self.optimizer, model_kwargs=self.model_kwargs, data_kwargs=self.data_kwargs,
                       loss_kwargs=self.loss_kwargs,
                       seed=self.seed, comm_backend=self.comm_backend, step_timeout=self.step_timeout)

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

    def fit(self, steps: int, *, callback: StepCallback | None = None) -> FitResult:
        """Train ``steps`` steps; return the losses, the final state_dict and the step records.

        Raises:
            coordinator.runtime.driver.JobFailed: A worker failed or vanished (names worker, service, step).
            coordinator.planning.planner.PlanningError: No plan fits.
        """
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
            pool = self.local = LocalHarness(names, job=job.name, lease_ttl=job.lease_ttl, threads=threads,
                                             log_dir=job.log_dir)
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
            _, cells = build_cells(job.model, job.model_kwargs, job.seed)
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
        model, cells = build_cells(self.job.model, self.job.model_kwargs, self.job.seed)
        state = state_dict_of(model, cells, self.runtime.state())
        return FitResult(losses=[r.loss for r in records], state_dict=state, steps=records, plan=plan)

    def close(self) -> None:
        if self.runtime is not None and self.local is None:
            self.runtime.close()
        if self.loop is not None:
            self.loop.close()
        if self.local is not None:
            self.local.close()
