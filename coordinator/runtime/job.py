"""The Python API: ``Job(config)`` or ``Job(model=..., loss=..., data=...)``, ``plan()``, ``fit()``.

A job is its config (:class:`~coordinator.planning.config.JobConfig`), given whole or as flat
keyword fields, one per config field: a section's factory or name is the section's name
(``model=``, ``optimizer=``, ``eval=``); its arguments, and every field of the ``checkpoint``,
``logging`` and ``eval`` sections (whose names are vague alone), are ``<section>_<field>``
(``model_kwargs=``, ``logging_level=``, ``logging_run_dir=``, ``checkpoint_keep=``,
``eval_every_steps=``); any
other field is its own name wherever it sits (``global_batch`` is ``data.global_batch``,
``num_stages`` is ``plan.num_stages``, ``workers`` is ``runtime.workers``).
:data:`~coordinator.planning.config.FLAT_KEYS` lists them all. A job names its model, data
and loss by importable factories (``coordinator/runtime/factories.py``), so the workers build
them themselves. ``plan()`` builds the model in this process, traces and profiles it on a
sample microbatch (on a GPU when the workers run on GPUs: ``coordinator/runtime/devices.py``) and
asks the planner (``coordinator/planning/planner.py``) with the config's plan section.
``fit(steps)`` runs the plan on the embedded local harness (``Resources`` describe local worker
processes for now) and returns the loss history, the event log of every step and the final
parameters as a plain ``state_dict`` of the unwrapped model (:meth:`Job.build_model`; it loads
with ``strict=True``), and the evaluations on the held-out data if the job has an ``eval``
section (``coordinator/runtime/evaluation.py``).

Sessions. Outside a ``with job:`` block each ``fit`` starts the workers, trains from the
factory's initial parameters and tears everything down. Inside one, the workers stay up
and successive ``fit`` calls continue training (steps and samples carry on).
``with job.attach(pool):`` runs the session on workers that are already up (a test
fixture's harness shared by many jobs, or a cluster's pods:
:class:`~coordinator.runtime.cluster.ClusterWorkers`): the job's services are released at the
end, the workers stay.

[Note: the plan's own size]
The profile times each node on the sample (``b``, at most 8 samples) and on ``4b``, and fits a line
through them ([Note: profile timing] in ``coordinator/planning/profile.py``); the search weighs every
candidate on that line. The plan it chooses may run microbatches of another size, priced where nothing
was timed: on 2026-12-02 a one-worker plan of bench.models:mlp (one microbatch of 64 samples) was
priced at 44.3 ms by the line through 8 and 32 samples and at 47.8 ms by timings at 64 taken the next
minute; in a run of bench/train.py the same hour, at 42.3 ms against 52.3 (the run's careful profile at
64 samples: 52.2), while its steps took 39-62 ms (docs/benchmarks.md, "Training"). So once the
plan is chosen, :meth:`Job.plan` times the nodes again on a microbatch of the plan's own size (the
sample tiled; one size, at least 3 runs a node: ``profile_graph(size=..., scaled=False)``) and prices
the same plan on those times (``coordinator.planning.planner.repriced``): its predicted step, stage
costs and memory are that size's. The choice stays the search's: the other candidates were weighed on
the line, as :meth:`Job.candidates` (``cellmesh plan``'s runners-up) lists them, and :attr:`Job.weighed`
keeps the chosen plan as the search priced it. A model that does not run at the plan's size, or a plan
that does not fit on the new timings, keeps the search's price (a warning says so).

[Note: what the invariant compares]
``coordinator/runtime/reference.py`` trains one process on the same global batches (the
sampler's, in order) with the same optimizer: every plan must end at its parameters, to
float64 rounding.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch import nn

from coordinator.planning.config import JobConfig, PlanConfig, SchedulerConfig, from_flat
from coordinator.planning.data import BatchSampler
from coordinator.planning.devices import with_devices
from coordinator.planning.graph import Graph, build_graph
from coordinator.planning.memory import AUTOMATIC, Automatic
from coordinator.planning.plan import Plan
from coordinator.planning.planner import Candidate, candidate_plans, choose_plan, repriced
from coordinator.planning.profile import OPTIMIZER_STATE_FACTORS, Profile, profile_graph
from coordinator.planning.request import PlanningError, batch_norm_request, batch_note, check_batch_norm_plan
from coordinator.planning.resources import Resources
from coordinator.runtime.checkpoints import FINAL_MODEL, resolve_resume, save_state_dict
from coordinator.runtime.cluster import WorkerPool
from coordinator.runtime.devices import DeviceRequest, local_resources, profile_device
from coordinator.runtime.errors import JobError, located
from coordinator.runtime.factories import build_data, build_model, factory_path, unwrapped
from coordinator.runtime.harness import LocalHarness
from coordinator.runtime.preflight import (
    Checked,
    batch_norm_of,
    check_enough_samples,
    check_job,
    model_structure,
)
from coordinator.runtime.records import EvalRecord, Recovery, StepRecord
from coordinator.runtime.runspec import RunSpec
from coordinator.runtime.scaler import ScalerState
from coordinator.runtime.session import Session
from services.compute.chain import Chain
from services.compute.precision import autocast, device_type
from services.compute.stage import to_device
from services.params.zero import NOT_ELEMENTWISE
from services.protocol import OptimizerSpec, SchedulerSpec

__all__ = ["FitResult", "Job", "StepCallback", "optimizer_spec", "state_dict_of"]

log = logging.getLogger(__name__)

PROFILE_REPEATS = 3  # the fewest timed runs per node and size of plan()'s profiles ([Note: profile timing])
# A search longer than this (seconds) with no stage count set says how a job narrows it: at cluster size the
# free search weighs every stage count, and a fixed one plans most resource lists well under a second
# (docs/running.md, "Planning for a cluster").
SLOW_SEARCH_S = 1.0

StepCallback = Callable[[StepRecord], None]
OptimizerRef = str | type[torch.optim.Optimizer]


@dataclass
class FitResult:
    """What ``fit`` returns: per-step losses, the final ``state_dict``, every step's record, the plan, the
    evaluations on the held-out data (in step order)."""

    losses: list[float]
    state_dict: dict[str, torch.Tensor]
    steps: list[StepRecord] = field(default_factory=list)
    plan: Plan | None = None
    recoveries: list[Recovery] = field(default_factory=list)  # failures survived during this fit
    evals: list[EvalRecord] = field(default_factory=list)
    # each step's whole-gradient L2 norm before clipping (None where unknown: the parameter-server path)
    grad_norms: list[float | None] = field(default_factory=list)


def optimizer_spec(optimizer: OptimizerRef, kwargs: dict[str, Any],
                   scheduler: SchedulerConfig | None = None) -> OptimizerSpec:
    """A ``torch.optim`` class (or its name), its arguments and its learning-rate scheduler (checked by
    the preflight: ``coordinator/runtime/preflight.py``), as the services take them.

    Raises:
        ValueError: Not a ``torch.optim`` optimizer class.
    """
    name = optimizer if isinstance(optimizer, str) else optimizer.__name__
    cls = getattr(torch.optim, name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)) or (
            not isinstance(optimizer, str) and cls is not optimizer):
        raise ValueError(f"optimizer {optimizer!r} is not a torch.optim optimizer class")
    clean = {k: list(v) if isinstance(v, tuple) else v for k, v in kwargs.items()}
    schedule = (SchedulerSpec(name=scheduler.name, kwargs=dict(scheduler.kwargs))
                if scheduler is not None else None)
    return OptimizerSpec(name=name, kwargs=clean, scheduler=schedule)


def _named(fields: dict[str, Any]) -> dict[str, Any]:
    """``Job``'s keyword fields with factory functions as their names and an optimizer class as its name.

    Raises:
        ValueError: A function is not importable by name, or a class is not ``torch.optim``'s.
    """
    named = dict(fields)
    for key in ("model", "data", "loss", "eval", "eval_metric"):
        if callable(named.get(key)):
            named[key] = factory_path(named[key], what=f"{key.replace('_', ' ')} factory")
    if isinstance(named.get("optimizer"), type):
        named["optimizer"] = optimizer_spec(named["optimizer"], {}).name
    return named


def state_dict_of(model: nn.Module, named: Sequence[tuple[str, torch.Tensor]],
                  state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (the stages' names) keyed as ``model.state_dict()`` names the tensors of ``named``.

    ``named`` is the model's tensors under the stages' names (``Chain.named_tensors``). The values
    are ``state``'s own tensors (not copies): a parameter tied under two keys is one tensor under
    both, as in ``model.state_dict()``. ``model`` may be on the meta device.

    Raises:
        KeyError: An entry of the model's state has no counterpart in ``state``.
    """
    by_id: dict[int, str] = {id(t): n for n, t in named}
    out: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        name = by_id.get(id(value))
        if name is None or name not in state:
            raise KeyError(f"state entry {key!r} of the model was not returned by any stage")
        out[key] = state[name].detach()
    return out


def _check_precision(precision: str, chain: Chain) -> None:
    """Refuse mixed precision over a model that autocast would not cast (see [Note: mixed precision]
    in ``services/compute/precision.py``).

    Raises:
        JobError: ``precision`` is bf16 or fp16 and a floating-point parameter is not float32.
    """
    if precision == "fp32":
        return
    other = next(((name, p.dtype) for name, p in chain.named_parameters()
                  if p.is_floating_point() and p.dtype != torch.float32), None)
    if other is not None:
        raise JobError(f"plan.precision={precision} autocasts float32 tensors only, but parameter {other[0]} "
                       f"is {str(other[1]).removeprefix('torch.')}: build the model in float32 (its master "
                       "weights) or set plan.precision: fp32")


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
        resources: The workers; default this machine's ``config.runtime.workers`` local workers, on a GPU
            each where ``runtime.device`` allows (``coordinator/runtime/devices.py``). Given, they
            replace the local workers the config describes (a cluster's, a custom description).
        plan: A complete plan to use as is (the config's plan section is then not consulted; the
            resource list and ``runtime.device`` say where its stages run).
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
        held_out = config.eval
        named = {"model": config.model.factory, "data": config.data.factory, "loss": config.loss.factory,
                 "eval": held_out and held_out.factory, "eval metric": held_out and held_out.metric}
        for what, path in named.items():
            if path:
                factory_path(path, what=f"{what} factory", code_dir=config.runtime.code_dir)
        self.config = config
        self.optimizer = optimizer_spec(config.optimizer.name, dict(config.optimizer.kwargs),
                                        config.optimizer.scheduler)
        self.resources = resources or local_resources(config.runtime)
        self.name = config.name or f"job-{uuid.uuid4().hex[:8]}"
        if plan is not None:  # the resource list and runtime.device say where its stages run
            plan = with_devices(plan, self.resources, config.runtime.device)
        self.fixed_plan = plan
        self.log_dir = log_dir
        self._plan = plan
        self._checked: Checked | None = None
        self._batch_norm: tuple[str, ...] | None = None  # the model's BatchNorm layers, once known
        self._session: Session | None = None
        self._profile: Profile | None = None
        # the chosen plan as the search priced it, when plan() priced it again ([Note: the plan's own size])
        self.weighed: Plan | None = None
        self.search_s: float | None = None  # how long plan()'s search took (None: no search yet, or none)
        self.search_hint: str | None = None  # how a job narrows that search, where it was slow and free
        self.steps_done = 0

    # -- building and planning ------------------------------------------------------------

    def build_model(self) -> nn.Module:
        """The unwrapped model with its initial parameters (the module ``fit``'s state_dict loads into)."""
        model = self.config.model
        return unwrapped(build_model(model.factory, model.kwargs, self.config.data.seed))

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
        check_enough_samples(self.config, n)
        return BatchSampler(n, data.global_batch, shuffle=data.shuffle, seed=data.seed)

    def check(self) -> Checked:
        """Check the job before any worker starts (``coordinator/runtime/preflight.py``), for :meth:`plan`.

        Raises:
            coordinator.runtime.errors.JobError: A factory raises, the model does not trace, the data is
                inconsistent, a node or the loss fails on a sample, the plan asks for more stages than the
                model has nodes, or mixed precision is asked of a model that is not float32.
            coordinator.planning.request.PlanningError: No plan can hold the model, or the global
                batch does not split into the fixed replicas or microbatches.
        """
        if self._checked is None:
            checked = check_job(self.config, self.resources, _optimizer_kind(self.optimizer))
            _check_precision(self.config.plan.precision, checked.chain)
            self._checked = checked
        return self._checked

    def plan(self) -> Plan:
        """The plan (computed once): the plan section's fixed fields as given, the rest chosen by the planner.

        The job is checked first (:meth:`check`). When the global batch keeps the planner from
        using every worker, a warning says so and what batch would (``batch_note``).

        Raises:
            coordinator.planning.request.PlanningError: No plan satisfies the fixed fields and the resources.
            coordinator.runtime.errors.JobError: The job fails a check (see :meth:`check`).
            ValueError: The model fails on the sample microbatch (naming the node and its inputs).
        """
        if self._plan is None:
            config, checked = self.config, self.check()
            self._batch_norm = checked.batch_norm
            # the cut tensors as the stages will send them: the dtypes autocast gives them
            params = (p for _, p in checked.chain.named_parameters())
            with autocast(config.plan.precision, device_type(params)):
                graph = build_graph(checked.chain, checked.sample)
            device = profile_device(self.resources, config.runtime.device)  # where the workers will run
            request = batch_norm_request(config.plan, self._batch_norm)  # exact plans only
            try:
                graph.module.to(device)
                sample = to_device(checked.sample, device)
                kind = _optimizer_kind(self.optimizer)
                profile = self._profile = profile_graph(graph, sample, repeats=PROFILE_REPEATS,
                                                        optimizer=kind, num_threads=1)
                started = time.perf_counter()
                plan = choose_plan(profile, self.resources, request, global_batch=config.data.global_batch,
                                   automatic=self._automatic())
                self._searched(time.perf_counter() - started, request)
                plan = self._at_own_size(plan, graph, sample, request)
            finally:
                graph.module.to("cpu")
            self._plan = self._placed(plan)
            self._checked = None  # the model built for the checks is not needed any more
            note = batch_note(self._plan.data_parallel, self._plan.num_stages, config.plan,
                              self.resources.num_workers, config.data.global_batch)
            if note is not None:
                log.warning("%s", note)
        elif self._batch_norm is None:  # a plan given whole: it must give BatchNorm layers the global batch
            self._batch_norm = batch_norm_of(model_structure(self.config)[1])
            check_batch_norm_plan(self._batch_norm, self._plan.num_microbatches, self._plan.data_parallel,
                                  self._plan.mode)
        return self._plan

    def _searched(self, seconds: float, request: PlanConfig) -> None:
        """Keep and say how long the planner's search took, and how to narrow a slow one."""
        workers = self.resources.num_workers
        self.search_s = seconds
        log.info("the planner searched the plans for %d worker(s) in %.2f s", workers, seconds)
        if seconds > SLOW_SEARCH_S and request.num_stages is None:
            self.search_hint = (f"the search weighed every stage count for {workers} workers: a job "
                                "that sets plan.num_stages (and plan.schedule) searches only the plans "
                                "that have them")
            log.info("%s", self.search_hint)

    def _at_own_size(self, plan: Plan, graph: Graph, sample: Any, request: PlanConfig) -> Plan:
        """``plan`` priced on timings at its own microbatch size ([Note: the plan's own size])."""
        assert self._profile is not None
        size, profiled = plan.microbatch_size, self._profile.microbatch_size
        if size == profiled:
            return plan
        try:
            own = profile_graph(graph, sample, repeats=PROFILE_REPEATS, num_threads=1, size=size,
                                scaled=False, optimizer=_optimizer_kind(self.optimizer))
            again = repriced(plan, own, self.resources, request, automatic=self._automatic())
        except Exception as exc:  # the search's price stands; the run itself reports a model that fails
            log.warning("the plan keeps the price of the %d-sample profile: timing it on its own microbatch "
                        "of %d samples failed: %s", profiled, size, located(exc))
            return plan
        log.info("the plan priced on %d-sample microbatches: step %.3f ms (weighed at %.3f ms on the "
                 "%d-sample profile)", size, again.step_time_s * 1e3, plan.step_time_s * 1e3, profiled)
        self.weighed = plan
        return again

    def candidates(self, limit: int | None = None) -> list[Candidate]:
        """Every plan :meth:`plan` weighed, fitting or not (``cellmesh plan`` prints the fastest as the
        runners-up): the search run again on the kept profile; empty for a plan given whole. ``limit``:
        only the ``limit`` best (``planner.candidate_plans``)."""
        self.plan()
        if self._profile is None:
            return []
        request = batch_norm_request(self.config.plan, self._batch_norm or ())
        return candidate_plans(self._profile, self.resources, request,
                               global_batch=self.config.data.global_batch, automatic=self._automatic(),
                               limit=limit)

    def replan(self, resources: Resources) -> Plan:
        """A plan for other resources (the workers left after a failure, or back), with the same global batch.

        The plan section's fixed fields are kept where they fit; if they do not (2 replicas fixed
        and 3 workers left), the shape fields are dropped and a warning names them.

        Raises:
            coordinator.planning.request.PlanningError: No plan fits ``resources`` at all.
        """
        self.plan()
        assert self._profile is not None
        config, batch = self.config, self.config.data.global_batch
        layers = self._batch_norm or ()
        try:
            plan = choose_plan(self._profile, resources, batch_norm_request(config.plan, layers),
                               global_batch=batch, automatic=self._automatic())
        except PlanningError as exc:
            shape: dict[str, Any] = {"data_parallel": None, "num_stages": None, "balance": None,
                                     "strategy": "auto"}
            # then the sharding, which needs replicas the workers left may not hold (one worker: none)
            sharding: dict[str, Any] = {**shape, "zero": None, "shard_factor": None}
            error: PlanningError = exc
            for dropped in (shape, sharding):
                fixed = [k for k in dropped if getattr(config.plan, k) not in (None, "auto")]
                if not fixed or (dropped is sharding and config.plan.zero is None):
                    continue
                try:
                    request = batch_norm_request(config.plan.model_copy(update=dropped), layers)
                    plan = choose_plan(self._profile, resources, request, global_batch=batch,
                                       automatic=self._automatic())
                except PlanningError as again:
                    error = again
                    continue
                log.warning("the plan section's %s do not fit %d workers (%s); planning without them",
                            ", ".join(f"plan.{k}" for k in fixed), resources.num_workers, exc)
                return self._placed(plan, resources)
            raise error from None
        return self._placed(plan, resources)

    def _automatic(self) -> Automatic:
        """The memory options the planner may pick for this job ([Note: what the automatic search may
        pick] in ``coordinator/planning/memory.py``): no sharding for an optimizer that is not elementwise,
        no recompute over BatchNorm layers (their statistics would update twice)."""
        zero = AUTOMATIC.zero
        if self.optimizer.name in NOT_ELEMENTWISE:
            zero = (0,)
        recompute = AUTOMATIC.recompute and not self._batch_norm
        return dataclasses.replace(AUTOMATIC, zero=zero, recompute=recompute)

    def _placed(self, plan: Plan, resources: Resources | None = None) -> Plan:
        """``plan`` with the kind of device of each stage's workers (``coordinator/planning/devices.py``)."""
        return with_devices(plan, resources or self.resources, self.config.runtime.device)

    def run_spec(self, workers_job: str, run: str, *, state_keys: Mapping[str, list[str]] | None = None,
                 holders: Mapping[str, tuple[int, ...]] | None = None, restore: str = "",
                 scaler: ScalerState | None = None) -> RunSpec:
        """What the runtime builds services from; ``workers_job`` is the workers' registry prefix.

        ``state_keys`` names each tensor in the model's ``state_dict`` (checkpoints); ``holders`` gives
        each tensor's nodes (``Chain.holders``: which stages hold it); ``restore`` is the checkpoint the
        services start from, ``scaler`` the loss scale's state saved with it (fp16).
        """
        c, e = self.config, self.config.eval
        return RunSpec(job=workers_job, run=run, model=c.model.factory, data=c.data.factory,
                       loss=c.loss.factory, optimizer=self.optimizer, model_kwargs=c.model.kwargs,
                       data_kwargs=c.data.kwargs, loss_kwargs=c.loss.kwargs, seed=c.data.seed,
                       devices=DeviceRequest.of(c.runtime, self.resources), nonfinite=c.runtime.nonfinite,
                       clip_grad_norm=c.optimizer.clip_grad_norm, accumulate=c.optimizer.accumulate,
                       gather_bytes=c.plan.gather_bytes,
                       step_timeout=timedelta(seconds=c.runtime.step_timeout_s),
                       state_keys=dict(state_keys or {}), restore=restore, scaler=scaler,
                       holders=dict(holders or {}), leaves=tuple(c.model.leaves),
                       eval_data=e.factory if e else "", eval_data_kwargs=e.kwargs if e else {},
                       metric=(e.metric or "") if e else "")

    # -- training -------------------------------------------------------------------------

    def __enter__(self) -> Job:
        self._session = Session(self, None).start()
        return self

    @contextmanager
    def session(self, *, pool: WorkerPool | None = None,
                resume: Path | str | bool | None = None) -> Iterator[Job]:
        """A session (``with job.session(resume=True):``) on ``pool``'s workers or the local harness,
        starting from a checkpoint when ``resume`` is given (see :meth:`fit`)."""
        checkpoint = resolve_resume(resume, self.config.checkpoint.directory) if resume else None
        self._session = Session(self, pool, checkpoint).start()
        try:
            yield self
        finally:
            self.__exit__(None, None, None)

    @contextmanager
    def attach(self, pool: WorkerPool, *, resume: Path | str | bool | None = None) -> Iterator[Job]:
        """A session on ``pool``'s running workers (which must include the resources' workers)."""
        with self.session(pool=pool, resume=resume):
            yield self

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

    def fit(self, steps: int | None = None, *, callback: StepCallback | None = None,
            resume: Path | str | bool | None = None) -> FitResult:
        """Train ``steps`` steps (default: the config's ``steps``); return the losses, the final
        state_dict and the step records.

        ``resume`` (outside a session): start from a checkpoint (True: the newest under the job's
        ``checkpoint.directory``, training from the beginning if there is none yet; a path: that
        checkpoint, or the newest under it). ``steps`` then counts from the job's start, so the
        run ends where an uninterrupted one would: a checkpoint of step 60 and ``steps=100``
        trains 40 more. The checkpoint may come from any plan and worker count.

        Raises:
            coordinator.runtime.driver.JobFailed: A worker failed or vanished (names worker, service, step).
            coordinator.planning.request.PlanningError: No plan fits.
        """
        steps = self.config.steps if steps is None else steps
        if steps < 0:
            raise ValueError(f"steps must be >= 0, got {steps}")
        if self._session is None:
            with self.session(resume=resume):
                return self._fit(max(0, steps - self.steps_done) if resume else steps, callback)
        if resume:
            raise ValueError("resume= opens a session: give it outside `with job:` (or to job.session())")
        return self._fit(steps, callback)

    def _fit(self, steps: int, callback: StepCallback | None) -> FitResult:
        session = self._session
        if session is None:
            raise RuntimeError("the job's session is closed")
        done = session.reported  # a worker lost while the session placed its plan is this fit's too
        records, stage_state = session.fit(steps, callback)
        session.reported = len(session.recoveries)
        state = state_dict_of(session.model, session.chain.named_tensors(), stage_state)
        if session.checkpointer is not None:  # beside the checkpoints: the final model as a plain file
            save_state_dict(state, session.checkpointer.root / FINAL_MODEL)
        return FitResult(losses=[r.loss for r in records], state_dict=state, steps=records, plan=session.plan,
                         recoveries=session.recoveries[done:], evals=[r.eval for r in records if r.eval],
                         grad_norms=[r.grad_norm for r in records])
