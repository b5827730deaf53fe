"""A training session: the workers, event loop and runtime of one ``with job:`` block, kept going
through failures by checkpoints, resume, replaced workers and new plans.

One :class:`Session` per ``with job:`` block (or per ``Job.fit`` outside one). It starts (or
attaches to) the workers, places the plan through a :class:`~coordinator.runtime.driver.Runtime`
and runs steps, taking checkpoints as the job's ``checkpoint`` section says
(``coordinator/runtime/checkpoints.py``). Resuming (``Job.fit(resume=...)``, ``cellmesh run
--resume``) places every service restored from a checkpoint, whatever plan saved it: the
tensors are keyed by name, each stage loads its own.

[Note: surviving a lost worker]
A worker whose process dies or freezes is noticed when its registry lease lapses (its card
vanishes: within the lease TTL and the registry's expiry tick) or when a step fails and the
worker does not answer a probe. The runtime raises ``JobFailed(lost=True)``; a refusal by a
live worker (a bug in the job, a bad option) is not retried. Then, within
``runtime.max_restarts`` (each failure named when the budget is spent):

1. fence: the runtime is dropped and a new one made under a new run id (the epoch): new
   service names, new communicator prefixes. Whatever an old service still sends is refused
   (no such request, no such peer); its services on live workers are released;
2. replace: the pool restarts the worker under the same name (the local harness kills
   whatever is left of the old process first; on Kubernetes the StatefulSet restarts the pod)
   and the new process registers with a new incarnation;
3. roll back: every service of the new runtime is restored from the newest checkpoint (or
   built from the factories when the job has none), and training goes on from that step.
   Each step is a function of the parameters and the step's batch, so the steps run again
   give exactly the results they gave before; the final parameters are those of a run
   without the failure, and no sample is skipped or trained twice into the model.

Rolling back through storage for every plan, rather than copying a live data-parallel
replica's state, is a choice: it is the one path that works for every plan (a pipeline stage
has no replica; a parameter-server shard's optimizer state is nowhere else), the live
replicas may be mid-way through a step that half-applied, and on one host the checkpoint's
files are in the page cache, so loading them costs less than the replacement's start.

Elastic: when no replacement registers within ``runtime.replace_timeout_s`` (a node gone for
good), the session plans again on the workers left (the plan section's shape fields dropped
when they no longer fit: a warning says which) with the same global batch, restores from the
newest checkpoint and goes on; when the worker comes back, the session checkpoints and plans
again on the full resources at the next step. Each change is logged as a warning (the
terminal of ``cellmesh run`` shows it) and kept in :attr:`Session.recoveries` (the run record).
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from comm.codec import unpack
from comm.heap import scheduled, tidy
from coordinator.planning.plan import Plan
from coordinator.planning.request import PlanningError
from coordinator.planning.resources import Resources
from coordinator.runtime.accumulation import step_batches
from coordinator.runtime.async_steps import refuse_unsupported
from coordinator.runtime.checkpoints import (
    Checkpointer,
    TrainerState,
    checkpoint_key,
    model_state,
    newest,
    read_trainer,
    state_keys,
)
from coordinator.runtime.cluster import WorkerPool
from coordinator.runtime.driver import Runtime
from coordinator.runtime.errors import JobError, JobFailed
from coordinator.runtime.evaluation import Evaluation
from coordinator.runtime.factories import build_chain, factory_roots, job_factories
from coordinator.runtime.harness import LocalHarness, memory_limits
from coordinator.runtime.loop import EventLoop
from coordinator.runtime.nonfinite import NonFiniteStep
from coordinator.runtime.preflight import check_optimizer, model_structure
from coordinator.runtime.records import DetailBudget, EvalRecord, Recovery, StepRecord
from coordinator.runtime.tied import shared_parameters
from services.protocol import WorkerCard

if TYPE_CHECKING:
    from coordinator.runtime.job import Job

__all__ = ["Session"]

log = logging.getLogger(__name__)

_runs = itertools.count()
_PROCESS_TAG = uuid.uuid4().hex[:4]
# a window of steps lasts about this long, by the last step's time ([Note: a window of steps])
WINDOW_SECONDS = 1.0
FIRST_WINDOW = 4  # steps in the first window, before any step was measured
RELEASE_TIMEOUT = timedelta(seconds=5)  # releasing the old runtime's services after a failure


class Session:
    """The harness, event loop and runtime of one ``with job:`` block (see the module docstring).

    Args:
        job: The job.
        pool: Running workers to use, or None to start the local harness ``job.resources`` describe.
        resume: The checkpoint to start from (see :func:`resolve_resume`), or None.
    """

    def __init__(self, job: Job, pool: WorkerPool | None, resume: Path | None = None) -> None:
        self.job = job
        check_optimizer(job.config)  # a fixed plan skips the preflight: its cheapest check still runs
        self.plan = job.plan()
        refuse_unsupported(job.config, self.plan)  # what an asynchronous plan cannot run
        self.sampler = job.sampler()
        self.accumulate = job.config.optimizer.accumulate  # global batches per step
        self.resume = resume
        self._detail = DetailBudget(job.config.runtime.detail_replies)  # each fit starts its own
        if resume is not None:  # refused before any worker starts
            self._check_trainer(resume)
        config = job.config
        names = [w.name for w in job.resources.workers]
        self.local: LocalHarness | None = None  # the harness this session starts and stops itself
        if pool is None:
            threads = max(1, min(w.cpus for w in job.resources.workers))
            code_dir = [config.runtime.code_dir] if config.runtime.code_dir is not None else []
            code_dir += factory_roots(job_factories(config))  # [Note: where a job's modules are found]
            lease_ttl = timedelta(seconds=config.runtime.lease_ttl_s)
            pool = self.local = LocalHarness(names, job=job.name, lease_ttl=lease_ttl, threads=threads,
                                             python_path=code_dir, log_dir=job.log_dir,
                                             factories=job_factories(config),
                                             memory_limits=(memory_limits(job.resources)
                                                            if config.runtime.memory_cap else None))
        self.harness: WorkerPool = pool
        missing = sorted({w for r in self.plan.placement for w in r} - set(self.harness.names))
        if missing:
            raise ValueError(f"the plan places stages on workers {missing} the harness does not run "
                             f"({self.harness.names})")
        section = config.checkpoint
        if section.directory is None and (section.every_steps or section.every_seconds):
            raise JobError("checkpoint.every_steps/every_seconds need checkpoint.directory (Job(..., "
                           "checkpoint_directory=...); cellmesh run takes the run directory's checkpoints/)")
        self.checkpointer = (Checkpointer(Path(section.directory), every_steps=section.every_steps,
                                          every_seconds=section.every_seconds, keep=section.keep)
                             if section.directory is not None else None)
        self.loop: EventLoop | None = None
        self.runtime: Runtime | None = None
        self.evaluation = Evaluation.of(config)  # None: the job evaluates nothing
        self.recoveries: list[Recovery] = []  # one per lost worker (and per worker come back)
        # lost workers replaced whose new runtime lost another before it placed: recorded once one places
        self._unplaced: list[tuple[JobFailed, float, float, str]] = []
        self.reported = 0  # how many of them a fit returned already
        self.failures: list[JobFailed] = []
        self._step_s: float | None = None  # the last step's seconds: how long a window of steps is
        # workers lost for good (no replacement came), with the incarnation that was lost
        self.gone: dict[str, str | None] = {}
        self._stopped_on = ""  # the lost worker the job stopped on (over its restart budget)
        model, chain = model_structure(config)  # names only: the values are the stages'
        self.model, self.chain = model, chain
        self._state_keys = state_keys(model, chain.named_tensors())
        self._holders = chain.holders()
        self._tied = shared_parameters(chain)  # a plan that cuts between their holders ties them

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> Session:
        """Start the workers (a local harness), the event loop, and place the plan (restored if resuming)."""
        try:
            started = time.monotonic()
            if self.local is not None:
                self.local.start()
            # the coordinator's presence lives as long as a worker's card: a GIL held for a second in this
            # process (a collection, torch) must not make an etcd run's workers take it for gone
            self.loop = EventLoop(self.harness.registry, self.harness.job,
                                  presence_ttl=timedelta(seconds=self.job.config.runtime.lease_ttl_s)).start()
            try:
                self._place(self.plan, self.resume)
            except JobFailed as exc:  # a worker lost while placing: recovered as one lost in a step
                failure: JobFailed | None = exc
                while failure is not None:
                    failure = self._recover(failure)
            log.info("[coordinator %s] up in %.1fs", self.job.name, time.monotonic() - started)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        if self.runtime is not None and self.local is None:  # not on the worker the job stopped on
            self.runtime.close(skip=self._stopped_on)
        if self.loop is not None:
            self.loop.close()
        if self.local is not None:
            self.local.close()

    def _place(self, plan: Plan, checkpoint: Path | None) -> None:
        """A new runtime (a new run id: the epoch) for ``plan``, its services restored from ``checkpoint``."""
        assert self.loop is not None
        job = self.job
        trainer = self._check_trainer(checkpoint) if checkpoint is not None else None
        initial: dict[str, torch.Tensor] = {}
        if plan.mode == "parameter_server":  # the shards start from the coordinator's copy
            initial = self._initial_params(checkpoint)
        addresses = {n: self.harness.address(n) for n in sorted({w for r in plan.placement for w in r})}
        # unique per coordinator process too: a restarted coordinator never meets its predecessor's names
        spec = replace(job.run_spec(self.harness.job, f"{job.name}-{_PROCESS_TAG}{next(_runs)}",
                                    state_keys=self._state_keys, holders=self._holders,
                                    restore=str(checkpoint.resolve()) if checkpoint is not None else "",
                                    scaler=trainer.scaler if trainer is not None else None),
                       tied=self._tied)
        self.runtime = Runtime(plan, spec, self.loop, self.harness.registry_url, addresses, initial)
        self.plan = plan
        job.steps_done = trainer.step if trainer is not None else 0
        self.runtime.place()
        if checkpoint is not None:
            log.info("[coordinator %s] resumed from %s at step %d", job.name, checkpoint, job.steps_done)

    def _check_trainer(self, checkpoint: Path) -> TrainerState:
        """The checkpoint's trainer state, refused if the data it was trained on differs from this job's.

        Raises:
            JobError: Naming each data field that differs (resuming would train on other batches).
        """
        trainer, sampler = read_trainer(checkpoint), self.sampler
        mine = {"data.global_batch": sampler.global_batch, "data.num_samples": sampler.num_samples,
                "data.seed": sampler.seed, "data.shuffle": sampler.shuffle,
                "optimizer.accumulate": self.accumulate}  # a step's batches: [Note: optimizer steps]
        theirs = {k: getattr(trainer, k.split(".")[1]) for k in mine}
        if mine != theirs:
            diff = ", ".join(f"{k} is {mine[k]} here, {theirs[k]} in the checkpoint"
                             for k in mine if mine[k] != theirs[k])
            raise JobError(f"cannot resume from {checkpoint}: {diff}; the batches would differ from the run "
                           "that saved it (use the job it was saved with)")
        return trainer

    def _initial_params(self, checkpoint: Path | None) -> dict[str, torch.Tensor]:
        """The parameter shards' starting values, by the stages' names: the checkpoint's or the factory's."""
        if checkpoint is None:
            model = self.job.config.model
            _, chain = build_chain(model.factory, model.kwargs, self.job.config.data.seed, model.leaves)
            return {n: p.detach() for n, p in chain.named_parameters()}
        values = model_state(checkpoint)
        return {name: values[self._state_keys[name][0]] for name, _ in self.chain.named_parameters()}

    # -- training ---------------------------------------------------------------------------

    def trainer_state(self, step: int) -> TrainerState:
        """What ``trainer.json`` records for a checkpoint of ``step`` steps done (``step * accumulate``
        global batches: the data position is theirs)."""
        sampler, scaler = self.sampler, self.runtime.scaler if self.runtime is not None else None
        epoch, k = divmod(step * self.accumulate, sampler.steps_per_epoch)
        return TrainerState(job=self.job.name, step=step, epoch=epoch,
                            offset=k * sampler.global_batch, global_batch=sampler.global_batch,
                            num_samples=sampler.num_samples, seed=sampler.seed, shuffle=sampler.shuffle,
                            accumulate=self.accumulate, plan=self.plan.summary(), saved_at=time.time(),
                            scaler=scaler.state() if scaler is not None else None)

    def fit(self, steps: int, callback: Callable[[StepRecord], None] | None,
            ) -> tuple[list[StepRecord], dict[str, torch.Tensor]]:
        """Train until ``steps`` more steps are done (through failures, see the module docstring).

        Returns:
            The record of each step of this call, in order, and the final state (by the stages' names).

        Raises:
            JobFailed: A worker refused (a bug, a bad option), or failures outran the restart budget.
        """
        end = self.job.steps_done + steps
        first = self.job.steps_done
        records: dict[int, StepRecord] = {}
        self._detail = DetailBudget(self.job.config.runtime.detail_replies)
        while True:
            try:
                with scheduled():  # the collector runs after each request (comm/heap.py), not within
                    self._train(end, records, callback)
                return [records[k] for k in range(first, end)], self._finish(end)
            except JobFailed as exc:
                failure: JobFailed | None = exc
                while failure is not None:  # a worker lost while recovering is one more failure
                    failure = self._recover(failure)

    def _train(self, end: int, records: dict[int, StepRecord], callback: Callable[[StepRecord], None] | None,
               ) -> None:
        ckpt = self.checkpointer
        while self.job.steps_done < end:
            runtime, plan = self.runtime, self.plan  # a worker that came back changes them
            assert runtime is not None
            k = self.job.steps_done
            save = None
            if ckpt is not None and ckpt.due(k):
                if runtime.can_save:
                    save = ckpt.begin(self.trainer_state(k), runtime.parts)
                elif k - 1 in records and records[k - 1].skipped:  # no commit to carry the save: next step
                    ckpt.defer(k)
            def batches_of(j: int, plan: Plan = plan) -> list[list[list[int]]]:
                return step_batches(self.sampler, j, self.accumulate, plan.data_parallel,
                                    plan.num_microbatches)

            steps = self._window(runtime, plan, k, end, self._step_s)
            try:
                if steps == 1:  # an asynchronous plan may send a replica later steps ahead (async_steps.py)
                    done = [runtime.run_step(k, batches_of(k), save, upcoming=batches_of, end=end)]
                else:
                    done = runtime.run_steps(k, [batches_of(j) for j in range(k, k + steps)], save)
            except NonFiniteStep as exc:  # the steps of the window before it were committed: they count
                for record in exc.before:
                    self._done(record, records, runtime, end, callback)
                raise
            for record in done:
                self._done(record, records, runtime, end, callback)
            tidy()  # the request's garbage, once (comm/heap.py: the steps collect on their own schedule)
            self._use_returned()

    def _done(self, record: StepRecord, records: dict[int, StepRecord], runtime: Runtime, end: int,
              callback: Callable[[StepRecord], None] | None) -> None:
        """Count a finished step: its checkpoint parts, its record, the evaluation due after it, the callback
        (in that order)."""
        if self.checkpointer is not None:
            self._announce(self.checkpointer.record(record.saved))
        self.job.steps_done += 1
        records[record.step] = record
        self._detail.add(record)  # after the checkpointer read its parts, before the callback reads it
        self._step_s = record.seconds
        if self.evaluation is not None and self.evaluation.due(self.job.steps_done, end):
            record.eval = self._evaluate(self.evaluation, runtime, end)
        if callback is not None:
            callback(record)

    def _window(self, runtime: Runtime, plan: Plan, k: int, end: int, last_s: float | None) -> int:
        """How many steps from step ``k`` go in one request ([Note: a window of steps] in
        ``services/protocol/compute.py``): ``runtime.steps_per_request`` (0: about :data:`WINDOW_SECONDS`
        of steps as long as the last one, ``last_s``; before the session's first step, as the plan predicts
        but at most :data:`FIRST_WINDOW`: a prediction may be far off), at most what the plan allows and
        what is left of the fit; a window ends where a checkpoint rides on the next commit or an evaluation
        is due."""
        auto = (max(1, int(WINDOW_SECONDS / max(last_s, 1e-6))) if last_s is not None else
                min(FIRST_WINDOW, max(1, int(WINDOW_SECONDS / max(plan.step_time_s, 1e-6)))))
        steps = min(runtime.window, end - k, self.job.config.runtime.steps_per_request or auto)
        for i in range(1, steps):
            if ((self.checkpointer is not None and self.checkpointer.due(k + i))
                    or (self.evaluation is not None and self.evaluation.due(k + i, end))):
                return i
        return steps

    def _evaluate(self, evaluation: Evaluation, runtime: Runtime, end: int) -> EvalRecord:
        """Commit with the checkpoint due (the final one at ``end``), then evaluate (see evaluation.py)."""
        done, ckpt = self.job.steps_done, self.checkpointer
        due = ckpt is not None and runtime.can_save and (done == end or ckpt.due(done))
        saved = runtime.commit(ckpt.begin(self.trainer_state(done), runtime.parts) if ckpt and due else None)
        evaluated, reported = evaluation.run(runtime, done)
        if ckpt is not None:
            self._announce(ckpt.record([*saved, *reported]))
        return evaluated

    def _finish(self, end: int) -> dict[str, torch.Tensor]:
        """Commit the last step (with the final checkpoint, if the job takes any); collect the state."""
        runtime, ckpt = self.runtime, self.checkpointer
        assert runtime is not None
        if ckpt is None:
            runtime.commit()
        else:
            save = (ckpt.begin(self.trainer_state(end), runtime.parts)
                    if runtime.can_save and end not in ckpt.pending else None)
            self._announce(ckpt.record(runtime.commit(save)))
            self._announce(ckpt.record(runtime.flush_saves()))
        return runtime.state()

    def _announce(self, published: list[Path]) -> None:
        """Name the newest checkpoint in the registry (``/cellmesh/{job}/checkpoint``): a coordinator that
        replaces this one finds it there (best effort: training never waits on it)."""
        if published:
            try:
                self.harness.registry.put(checkpoint_key(self.harness.job),
                                          str(published[-1].resolve()).encode())
            except Exception as exc:  # the registry may be briefly away; the files are what matters
                log.warning("[coordinator %s] could not name checkpoint %s in the registry: %s",
                            self.job.name, published[-1], exc)

    # -- failures ---------------------------------------------------------------------------

    def _recover(self, failure: JobFailed) -> JobFailed | None:
        """Replace the lost worker (or plan without it) and go on from the newest checkpoint.

        Returns:
            None, or the failure that lost a worker while recovering (to recover from in turn).

        Raises:
            JobFailed: ``failure`` itself if a live worker refused (not a lost one), or a summary of
                every failure once ``runtime.max_restarts`` is spent.
        """
        if not failure.lost:
            raise failure
        self.failures.append(failure)
        budget = self.job.config.runtime.max_restarts
        if len(self.failures) > budget:
            self._stopped_on = failure.worker  # lost: close() does not wait for it to release its services
            lines = "\n".join(f"  {i + 1}. step {f.step}: {f}" for i, f in enumerate(self.failures))
            raise JobFailed(f"the job lost workers {len(self.failures)} times, more than "
                            f"runtime.max_restarts={budget}; it stopped. Each failure:\n{lines}",
                            worker=failure.worker,
                            service=failure.service, step=failure.step) from failure
        noticed, started = time.time(), time.monotonic()
        log.warning("[coordinator %s] %s; recovering (restart %d of %d)", self.job.name, failure,
                    len(self.failures), budget)
        lost = self.runtime.placed_incarnation(failure.worker) if self.runtime is not None else None
        self._drop_runtime(lost=failure.worker)
        try:
            self._replace(failure, noticed, started, lost)
        except JobFailed as again:
            if not again.lost:
                raise
            return again
        return None

    def _replace(self, failure: JobFailed, noticed: float, started: float, lost: str | None) -> None:
        """Steps 2 and 3 of [Note: surviving a lost worker], or the elastic path."""
        address = None
        try:
            address = self.harness.replace(failure.worker, self._replace_timeout)
        except (TimeoutError, RuntimeError) as exc:
            log.warning("[coordinator %s] no replacement for worker %s: %s", self.job.name, failure.worker,
                        exc)
        if address is not None:
            assert self.loop is not None
            self.loop.connect(failure.worker, address)
            plan, action = self.plan, f"replaced worker {failure.worker}"
        else:
            self.gone[failure.worker] = lost
            plan = self._replan()
            action = f"re-planned on {len(self._workers_left())} workers without {failure.worker}"
        checkpoint = self._rollback_point()
        try:
            self._place(plan, checkpoint)
        except JobFailed as again:  # another worker lost: its recovery places, and records this one too
            if again.lost:
                self._unplaced.append((failure, noticed, started, action))
            raise
        resumed = self.job.steps_done
        for lost_one, at, began, done in [*self._unplaced, (failure, noticed, started, action)]:
            self.recoveries.append(Recovery(at=at, step=lost_one.step, worker=lost_one.worker,
                                            reason=str(lost_one), action=done, resumed_step=resumed,
                                            plan=plan.summary(), seconds=time.monotonic() - began))
        self._unplaced.clear()
        log.warning("[coordinator %s] %s; training goes on from step %d (%s) on %s", self.job.name, action,
                    self.job.steps_done + 1, f"checkpoint {checkpoint.name}" if checkpoint else "the start",
                    plan.summary())

    @property
    def _replace_timeout(self) -> timedelta:
        return timedelta(seconds=self.job.config.runtime.replace_timeout_s)

    def _drop_runtime(self, lost: str = "") -> None:
        """Release the failed runtime's services on the live workers; publish the checkpoints it finished
        writing (a part written but not reported yet counts; one live workers are still writing is waited
        for, bounded by the step timeout), drop the others ([Note: salvaging after a failure])."""
        runtime = self.runtime
        if self.checkpointer is not None:
            writers = runtime.part_writers() if runtime is not None else {}
            timeout = timedelta(seconds=self.job.config.runtime.step_timeout_s)
            salvaged = self.checkpointer.salvage(writers, lambda: self._lost_writers(writers, lost), timeout)
            self._announce(salvaged)
        if self.runtime is not None:
            self.runtime.close(RELEASE_TIMEOUT, skip=lost)
            self.runtime = None

    def _lost_writers(self, writers: dict[str, str], lost: str) -> set[str]:
        """Of the workers writing checkpoint parts, those lost: ``lost`` (the failure's), and each whose card
        vanished or changed incarnation since the runtime placed its services. The cards are read from the
        registry: the event loop's members change only as this thread reads its events."""
        assert self.loop is not None
        loop, runtime = self.loop, self.runtime
        try:
            members = {kv.key.removeprefix(loop.prefix): unpack(kv.value, WorkerCard)
                       for kv in loop.registry.list(loop.prefix)}
        except Exception as exc:  # the registry briefly away, a card of another version: what the loop read
            log.info("[coordinator %s] reading the worker cards: %s; using the members last seen",
                     self.job.name, exc)
            members = dict(loop.members)
        out = {lost} if lost else set()
        for worker in set(writers.values()):
            card = members.get(worker)
            placed = runtime.placed_incarnation(worker) if runtime is not None else None
            if card is None or (placed is not None and card.incarnation != placed):
                out.add(worker)
        return out

    def _rollback_point(self) -> Path | None:
        """The newest checkpoint (this job's, else the one the session resumed from); None: the start."""
        if self.checkpointer is not None:
            found = newest(self.checkpointer.root)
            if found is not None:
                return found
        return self.resume

    def _workers_left(self) -> list[str]:
        return [w.name for w in self.job.resources.workers if w.name not in self.gone]

    def _replan(self) -> Plan:
        """A plan on the workers left (the plan section's shape dropped if it no longer fits).

        Raises:
            JobFailed: No plan fits the workers left.
        """
        left = set(self._workers_left())
        if not left:
            gone = ", ".join(sorted(self.gone))
            raise JobFailed(f"no worker is left to plan on: every worker of the job ({gone}) was lost and "
                            "none was replaced; start workers again (or give the job replacements) and "
                            "resume from its last checkpoint", step=self.job.steps_done)
        resources = Resources(workers=tuple(w for w in self.job.resources.workers if w.name in left),
                              bandwidth_bps=self.job.resources.bandwidth_bps,
                              latency_s=self.job.resources.latency_s)
        try:
            return self.job.replan(resources)
        except PlanningError as exc:
            raise JobFailed(f"no plan fits the {len(left)} workers left ({', '.join(sorted(left))}): {exc}",
                            step=self.job.steps_done) from exc

    def _use_returned(self) -> None:
        """If a worker lost for good registered again: checkpoint, plan on the workers now there, restore.

        Without a checkpoint directory the session cannot carry the state over to a new plan, and
        goes on with the plan it has (said once).
        """
        assert self.loop is not None and self.runtime is not None
        members = self.loop.members  # a card of the lost process itself (its loss not yet read) is not back
        back = sorted(name for name, lost in self.gone.items()
                      if name in members and members[name].incarnation != lost)
        if not back:
            return
        if self.checkpointer is None:
            log.warning("[coordinator %s] worker(s) %s came back, but the job has no checkpoint.directory to "
                        "move its state to a new plan: it goes on with the plan it has", self.job.name,
                        ", ".join(back))
            for name in back:
                del self.gone[name]
            return
        started = time.monotonic()
        step = self.job.steps_done
        checkpoint = self._checkpoint_now()
        for name in back:
            del self.gone[name]
            self.loop.connect(name, self.loop.members[name].address)
        self._drop_runtime()
        plan = self._replan()
        action = f"re-planned on {len(self._workers_left())} workers: {', '.join(back)} came back"
        try:
            self._place(plan, checkpoint)
        except BaseException as exc:  # the record stays, saying how it ended (the failure's own comes next)
            self.recoveries.append(Recovery(at=time.time(), step=step, worker=", ".join(back),
                                            reason="worker registered again",
                                            action=f"{action}; placing that plan failed: {exc}"[:2000],
                                            resumed_step=self.job.steps_done, plan=plan.summary(),
                                            seconds=time.monotonic() - started))
            raise
        self.recoveries.append(Recovery(at=time.time(), step=step, worker=", ".join(back),
                                        reason="worker registered again", action=action,
                                        resumed_step=self.job.steps_done, plan=plan.summary(),
                                        seconds=time.monotonic() - started))
        log.warning("[coordinator %s] %s; training goes on from step %d on %s", self.job.name, action,
                    self.job.steps_done + 1, plan.summary())

    def _checkpoint_now(self) -> Path | None:
        """Commit and checkpoint the current step and wait until it is published; its path."""
        runtime, ckpt = self.runtime, self.checkpointer
        assert runtime is not None
        if ckpt is None:
            return None
        step = self.job.steps_done
        save = ckpt.begin(self.trainer_state(step), runtime.parts) if runtime.can_save else None
        self._announce(ckpt.record(runtime.commit(save)))
        self._announce(ckpt.record(runtime.flush_saves()))
        return newest(ckpt.root)

