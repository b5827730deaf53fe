"""``cellmesh run JOB``: load a job, print its plan, train with progress, write the final state_dict.

:func:`run_job` is the whole command without the argument parsing (``coordinator/commands/cli.py``)
and is what ``cellmesh demo`` calls too:

1. load the job (``coordinator/commands/jobspec.py``: a spec file or a job module), log as
   its config's ``logging`` section says, check its optimizer builds, the output path is
   writable (its temporary file is created and removed) and the job passes its checks
   (``Job.check``: ``coordinator/runtime/preflight.py``), then create the run directory
   (``coordinator/commands/output.py``) and print where it is. A bad job ends before that:
   nothing is written but its one-line error;
2. plan it (profile on a sample microbatch, ask the planner), print the plan's table and
   write it to ``plan.json``/``plan.txt``;
3. start the local harness (``Resources.local``: an embedded registry and one worker
   process per resource worker, each logging to ``workers/NAME.log``) and place the plan's services;
4. train, showing each finished step (``coordinator/commands/progress.py``) and recording it
   (``coordinator/commands/recorder.py``: run record, metrics, trace, TensorBoard);
5. write the final parameters with ``torch.save`` as a plain ``{name: tensor}`` dict to
   ``model.pt`` (and a copy to ``--output``) that loads into the job's model with ``strict=True``
   (``torch.load(path, weights_only=True)``), and print the loss at the start and the end, the
   throughput and where the run directory is. A place that cannot be written at the end does
   not lose the model: :func:`save_outputs` names where it is instead. A step whose loss is not
   finite stops the run before its update (``runtime.nonfinite: stop``, the default) and
   nothing is written: an earlier output stays as it was.

Errors a user can fix (:data:`USER_ERRORS`: a bad job file, a factory that does not
import or raises, cells that do not fit the data, a plan that does not fit, an output that
cannot be written, a loss that is not finite, a worker that failed) are raised to the
caller, whose :func:`describe_error` turns them into one line; the CLI prints it without a
traceback (unless ``--traceback``) and exits non-zero (:func:`exit_code`: 2 for the job as
given, 1 for a worker that failed).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

import torch

from coordinator.commands.jobspec import JobSpecError, LoadedJob, load_job
from coordinator.commands.output import apply_logging, open_recorder
from coordinator.commands.progress import describe_eval, make_progress
from coordinator.commands.recorder import RunRecorder
from coordinator.commands.rundir import RunDir, previous_checkpoint_roots
from coordinator.planning.config import OptimizerConfig
from coordinator.planning.profile import format_bytes
from coordinator.planning.request import PlanningError
from coordinator.runtime import forkserver
from coordinator.runtime.checkpoints import (
    checkpoint_key,
    newest,
    resolve_resume,
    save_state_dict,
    temporary_path,
)
from coordinator.runtime.cluster import WorkerPool
from coordinator.runtime.errors import JobError, JobFailed
from coordinator.runtime.job import FitResult, Job, StepCallback
from coordinator.runtime.preflight import check_optimizer
from coordinator.runtime.records import Recovery, StepRecord

__all__ = ["REPORTED", "USER_ERRORS", "OutputError", "RunOptions", "RunResult", "Terminated",
           "check_writable", "demo_job_path", "describe_error", "exit_code", "report", "run_demo_job",
           "run_job", "save_outputs", "save_state_dict", "summary", "train", "use_termination_as_exception"]

log = logging.getLogger(__name__)

DEFAULT_CHECKPOINT_SECONDS = 600.0  # cellmesh run: a checkpoint every 10 minutes unless the job says when

USER_ERRORS: tuple[type[BaseException], ...] = (JobSpecError, PlanningError, JobFailed, ValueError,
                                                TimeoutError)


class Terminated(BaseException):
    """SIGTERM or SIGHUP arrived: raised in the main thread so every ``with`` block tears down."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


# what the CLI reports without a traceback
REPORTED: tuple[type[BaseException], ...] = (*USER_ERRORS, KeyboardInterrupt, Terminated)
EXIT_USER_ERROR = 2  # the job as given cannot run: fix the job file, the options or the resources
EXIT_JOB_FAILED = 1  # the job started and a worker failed
EXIT_INTERRUPTED = 130


@dataclass(frozen=True)
class RunOptions:
    """``cellmesh run``'s options.

    Attributes:
        job: A job module (``.py``) or a job spec (``.yaml``/``.yml``/``.json``).
        settings: Config fields over the job's own, by dotted key (``{"plan.num_stages": 2}``).
        output: Where to write a copy of the state_dict (the run directory's ``model.pt`` is always written).
        bar: A progress bar (True), log lines (False), or a bar only on a terminal (None).
        log_every: Steps between log lines (about 20 lines per run by default).
        resume: Start from a checkpoint: True for the newest of this job's (its ``checkpoint.directory``,
            else the earlier run directories ``out/<job>-*``), or a checkpoint's path (see
            :func:`find_resume`); the run then ends at the same step an uninterrupted one would.
        trace: Also write the run's Chrome trace (measured and predicted steps) here at the end.

    Where the output goes and how the run logs are the config's ``logging`` section
    (``coordinator/commands/output.py``).
    """

    job: str
    settings: Mapping[str, Any] = field(default_factory=dict)
    output: Path | None = None
    bar: bool | None = None
    log_every: int | None = None
    resume: str | bool | None = None
    trace: Path | None = None


@dataclass
class RunResult:
    """What a run did: the job, the fit, its run directory, the state_dict's copy, and how fast it trained."""

    loaded: LoadedJob
    fit: FitResult
    run_dir: RunDir
    output: Path | None  # the copy --output asked for
    seconds: float  # from the first step's start to the last one's end
    samples_per_s: float  # after the first step, which warms up
    overall_samples_per_s: float  # including the first step


def run_job(options: RunOptions, out: TextIO | None = None) -> RunResult:
    """Load, plan, train and save (see the module docstring); progress and results go to ``out``.

    Raises:
        JobSpecError: The job file cannot be loaded.
        PlanningError: No plan fits the resources (the message names one that would).
        ValueError: The job is inconsistent (a factory's output, the optimizer's arguments...).
        JobFailed: A worker failed or vanished during training (names worker, service, step).
        TimeoutError: The workers did not start in time.
    """
    loaded = load_job(options.job, options.settings)
    apply_logging(loaded.job.config.logging)
    # the local workers' imports (in the fork server) run beside this process's checks and planning; after
    # the load, which refuses most bad jobs, so a refused one costs no imports of the server
    forkserver.prestart()
    return train(loaded, options, out)


def train(loaded: LoadedJob, options: RunOptions, out: TextIO | None = None, *,
          pool: WorkerPool | None = None, on_step: StepCallback | None = None,
          recorder: RunRecorder | None = None) -> RunResult:
    """:func:`run_job` after loading: plan, train on ``pool`` (default: local workers), save.

    Args:
        pool: Workers that are already up (a cluster's: the job's resources must name them);
            None starts ``Resources.local`` worker processes and stops them at the end.
        on_step: Called with each finished step's record (its update is applied when the next step
            starts, or by the final commit), after the progress display.
        recorder: The run's recorder, entered by the caller (the cluster coordinator's); None:
            one on the run directory of the config's ``logging`` section, for this call.
    """
    out = out or sys.stdout
    job = loaded.job
    if options.output is not None:  # first: the cheapest check (the optimizer's imports torch._dynamo)
        check_writable(options.output)
    check_optimizer(job.config)  # refuses bad arguments now, not in a step
    sampler = job.sampler()
    job.check()  # a bad job is refused here: before a run directory, a plan or a worker
    say = functools.partial(print, file=out, flush=True)
    with contextlib.ExitStack() as stack:
        if recorder is None:
            recorder = stack.enter_context(open_recorder(loaded.name, loaded.steps, job.config.logging))
        say(f"cellmesh run: {loaded.source}\n  run directory {recorder.run_dir.path}")
        if recorder.metrics_url is not None:
            say(f"  metrics at {recorder.metrics_url}/metrics")
        result = _train(loaded, options, say, out, pool, on_step, recorder, sampler.num_samples,
                        sampler.steps_per_epoch)
        recorder.update(phase="done")
    say(summary(result))
    return result


def _optimizer(section: OptimizerConfig) -> str:
    """The optimizer section in a few words: ``SGD(lr=0.1), scheduler StepLR(step_size=2), ...``."""
    def call(name: str, kwargs: Mapping[str, Any]) -> str:
        return f"{name}({', '.join(f'{k}={v}' for k, v in kwargs.items())})"

    words = [call(section.name, section.kwargs)]
    if section.scheduler is not None:
        words.append(f"scheduler {call(section.scheduler.name, section.scheduler.kwargs)}")
    if section.clip_grad_norm is not None:
        words.append(f"gradients clipped to norm {section.clip_grad_norm:g}")
    if section.accumulate > 1:
        words.append(f"{section.accumulate} global batches per step")
    return ", ".join(words)


def _train(loaded: LoadedJob, options: RunOptions, say: functools.partial[None], out: TextIO,
           pool: WorkerPool | None, on_step: StepCallback | None, recorder: RunRecorder,
           num_samples: int, steps_per_epoch: int) -> RunResult:
    """:func:`train` inside its recorder: describe, plan, train, save."""
    job, config = loaded.job, loaded.job.config
    section = config.optimizer  # a step is one update over `accumulate` global batches
    say(f"  model {config.model.factory}, data {config.data.factory} ({num_samples} samples, "
        f"{steps_per_epoch / section.accumulate:g} steps per epoch), loss {config.loss.factory}")
    where = "local workers" if pool is None else f"workers of {pool.registry_url}"
    say(f"  optimizer {_optimizer(section)}, global batch {config.data.global_batch}, "
        f"{loaded.steps} steps, {job.resources.num_workers} {where}")
    started = time.monotonic()
    plan = job.plan()
    say(f"planned in {time.monotonic() - started:.1f}s (profiled on a sample microbatch):\n")
    say(str(plan) + "\n")
    recorder.write_plan(plan)
    say(f"starting {job.resources.num_workers} worker processes..." if pool is None
        else f"placing services on {', '.join(pool.names)}...")
    started = time.monotonic()
    if pool is None:
        job.log_dir = recorder.run_dir.workers
    resume = find_resume(loaded, options.resume, pool)
    if pool is None:  # a cluster's checkpoints need storage every pod mounts: only where the job says
        use_checkpoints(job, recorder.run_dir)
    with job.session(pool=pool, resume=resume):
        steps = max(0, loaded.steps - job.steps_done)
        if resume is not None:
            say(f"resumed from {resume} at step {job.steps_done}")
            recorder.update(resumed_from=str(resume))
        say(f"workers up and services placed in {time.monotonic() - started:.1f}s; training "
            f"{steps} steps")
        recorder.update(phase="training", workers=[w.name for w in job.resources.workers])
        progress = make_progress(steps, out, bar=options.bar, every=options.log_every)

        def step_done(record: StepRecord) -> None:
            progress.update(record)
            recorder.on_step(record)
            if on_step is not None:
                on_step(record)

        try:
            fit = job.fit(steps, callback=step_done)
        finally:
            progress.close()
    for rec in fit.recoveries:
        say(f"  survived: {describe_recovery(rec)}")
    recorder.update(recoveries=[describe_recovery(r) for r in fit.recoveries],
                    checkpoint=str(newest(Path(job.config.checkpoint.directory or "")) or ""))
    save_outputs(fit.state_dict, recorder.run_dir, options.output)
    if options.trace is not None:
        recorder.write_trace(options.trace)
        say(f"trace of the measured and predicted steps written to {options.trace} (open it in Perfetto)")
    speed = progress.throughput
    return RunResult(loaded, fit, recorder.run_dir, options.output, speed.elapsed, speed.steady,
                     speed.overall)


def use_checkpoints(job: Job, run_dir: RunDir) -> None:
    """Give ``job`` the run's checkpoint defaults: the run directory's ``checkpoints/`` when the job names no
    directory, and one every :data:`DEFAULT_CHECKPOINT_SECONDS` when it sets no frequency (so a failure
    never costs more than that, and the end of the run is saved)."""
    section = job.config.checkpoint
    changes: dict[str, Any] = {}
    if section.directory is None:
        changes["directory"] = str(run_dir.checkpoints)
    if section.every_steps is None and section.every_seconds is None:
        changes["every_seconds"] = DEFAULT_CHECKPOINT_SECONDS
    if changes:
        job.config = job.config.model_copy(update={"checkpoint": section.model_copy(update=changes)})


def find_resume(loaded: LoadedJob, resume: str | bool | None, pool: WorkerPool | None = None) -> Path | None:
    """The checkpoint ``--resume`` means: a path as given (a checkpoint, or the newest under a directory);
    True: the newest under the job's ``checkpoint.directory``, else under its run directory's (or its
    earlier default run directories', ``out/<job>-*/checkpoints``), else the one a coordinator named in
    ``pool``'s registry; None if there is none yet (the run starts from the beginning).

    Raises:
        JobError: A path given holds no checkpoint.
    """
    if not resume:
        return None
    if resume is not True:
        return resolve_resume(resume, None)
    directory = loaded.job.config.checkpoint.directory
    if directory is not None:
        return resolve_resume(True, directory)
    roots = previous_checkpoint_roots(loaded.name) if loaded.job.config.logging.run_dir is None else [
        Path(loaded.job.config.logging.run_dir) / "checkpoints"]
    for root in roots:
        found = newest(root)
        if found is not None:
            return found
    announced = pool.registry.get(checkpoint_key(pool.job)) if pool is not None else None
    if announced is not None and (Path(announced.value.decode()) / "trainer.json").is_file():
        return Path(announced.value.decode())
    log.warning("--resume: no checkpoint of job %s yet: training starts from the beginning", loaded.name)
    return None


def describe_recovery(recovery: Recovery) -> str:
    """One line: which step, which worker, what was done, where training went on from."""
    when = time.strftime("%H:%M:%S", time.localtime(recovery.at))
    step = f"step {recovery.step + 1}" if recovery.step is not None else "between steps"
    return (f"{when} {step}: worker {recovery.worker} lost; {recovery.action}, went on from step "
            f"{recovery.resumed_step + 1} in {recovery.seconds:.1f}s")


def summary(result: RunResult) -> str:
    """The closing lines: loss at the start and the end, throughput, the last evaluation, where the run's
    files are."""
    losses, state = result.fit.losses, result.fit.state_dict
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    lines = []
    if losses:
        tail = losses[-min(10, len(losses)):]
        lines.append(f"done: {len(losses)} steps in {result.seconds:.1f}s, {result.samples_per_s:.1f} "
                     f"samples/s after the first step ({result.overall_samples_per_s:.1f} overall)")
        steps = result.fit.steps  # counted from the job's start: a resumed run's first is not step 1
        first, final = (steps[0].step + 1, steps[-1].step + 1) if steps else (1, len(losses))
        lines.append(f"loss {losses[0]:.4f} at step {first} -> {losses[-1]:.4f} at step {final} "
                     f"(mean of the last {len(tail)}: {sum(tail) / len(tail):.4f})")
    else:
        lines.append("done: 0 steps; the state_dict holds the initial parameters")
    if result.fit.evals:
        last = result.fit.evals[-1]
        lines.append(f"held-out {describe_eval(last)} after step {last.step} ({last.num_samples} samples; "
                     f"{len(result.fit.evals)} evaluation(s) in run.json)")
    copy = f" and {result.output}" if result.output is not None else ""
    lines.append(f"state_dict ({len(state)} tensors, {format_bytes(nbytes)}) written to "
                 f"{result.run_dir.model}{copy}")
    lines.append("  (load it with model.load_state_dict(torch.load(path, weights_only=True)))")
    lines.append(f"run directory {result.run_dir.path}: plan, logs (coordinator.log, workers/), trace.json, "
                 "run.json")
    return "\n".join(lines)


def save_outputs(state: dict[str, torch.Tensor], run_dir: RunDir, output: Path | None) -> None:
    """Write ``state`` to the run directory's ``model.pt`` and to ``output``; never lose it.

    A place that cannot be written (a full disk, a directory gone since :func:`check_writable`)
    does not stop the others; when none could be written, the state_dict goes to a new
    temporary directory.

    Raises:
        OutputError: A place could not be written; the message says why and where the state_dict is.
        OSError: Not even the temporary directory could be written.
    """
    failed: list[str] = []
    saved: list[Path] = []
    for path in [run_dir.model, *([output] if output is not None else [])]:
        try:
            save_state_dict(state, path)
            saved.append(path)
        except OSError as exc:
            failed.append(f"{path} ({exc.strerror or exc})")
    if not failed:
        return
    if not saved:
        saved.append(Path(tempfile.mkdtemp(prefix="cellmesh-model-")) / "model.pt")
        save_state_dict(state, saved[-1])
    raise OutputError(f"the trained state_dict could not be written to {', '.join(failed)}; it is saved in "
                      f"{saved[0]}: copy it from there")


class OutputError(ValueError):
    """An output path cannot be written; the message names it, why, and what to do."""


def check_writable(path: Path) -> None:
    """Fail before training, not after, if ``path`` cannot be written.

    Creates (and removes) the temporary file :func:`save_state_dict` writes beside ``path``,
    so a directory the permissions allow but the file system refuses (``/proc``, a read-only
    mount) fails here too. ``path`` itself is not touched: an earlier output stays as it is.

    Raises:
        OutputError: Its directory cannot be created or written, or it is a directory.
    """
    if path.is_dir():
        raise OutputError(f"cannot write the state_dict to {path}: it is a directory; give a file path (-o)")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"cannot create the output directory {path.parent}: {exc.strerror or exc}; give an "
                          "output path (-o) in a directory you can write") from None
    probe = temporary_path(path)
    try:
        with open(probe, "xb"):
            pass
    except OSError as exc:
        raise OutputError(f"cannot write the state_dict to {path}: {exc.strerror or exc}; give an output "
                          "path (-o) in a directory you can write") from None
    probe.unlink(missing_ok=True)


def describe_error(exc: BaseException) -> str:
    """One paragraph for a user error: what failed and, where the message has it, how to fix it."""
    message = " ".join(str(exc).split())
    if isinstance(exc, JobSpecError | JobError | OutputError):  # their messages name what failed
        return message
    if isinstance(exc, PlanningError):
        return f"no plan: {message}"
    if isinstance(exc, JobFailed):
        return f"the job failed: {message}"
    if isinstance(exc, TimeoutError):
        return f"timed out: {message}"
    return f"{type(exc).__name__}: {message}"


@contextmanager
def use_termination_as_exception() -> Iterator[None]:
    """Within the block, SIGTERM and SIGHUP raise :class:`Terminated` (main thread only).

    Python's default for SIGTERM ends the process without unwinding, which would leave the
    harness's workers (in sessions of their own) running; as an exception, ``with job:``
    tears them down as it does on Ctrl-C.
    """
    def on_signal(signum: int, frame: FrameType | None) -> None:
        raise Terminated(signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def exit_code(exc: BaseException) -> int:
    """The process exit code for ``exc`` (see the module's ``EXIT_*`` constants)."""
    if isinstance(exc, Terminated):
        return 128 + exc.signum
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    return EXIT_JOB_FAILED if isinstance(exc, JobFailed) else EXIT_USER_ERROR


def report(exc: BaseException, *, err: TextIO | None = None, show_traceback: bool = False) -> int:
    """Print ``exc`` for the user (with its traceback if asked) and return the exit code."""
    err = err or sys.stderr
    if show_traceback:
        traceback.print_exception(exc, file=err)
    text = ("interrupted" if isinstance(exc, KeyboardInterrupt)
            else str(exc) if isinstance(exc, Terminated) else describe_error(exc))
    print(f"cellmesh: error: {text}", file=err, flush=True)
    return exit_code(exc)


def demo_job_path() -> Path:
    """``examples/charlm.py``: in the current directory's ``examples/`` if there, else beside the package.

    Raises:
        JobSpecError: Neither exists (a non-editable install ships no examples).
    """
    here = Path.cwd() / "examples" / "charlm.py"
    beside = Path(__file__).resolve().parent.parent / "examples" / "charlm.py"
    for candidate in (here, beside):
        if candidate.is_file():
            return candidate
    raise JobSpecError(f"the demo job examples/charlm.py is neither in {here.parent} nor in {beside.parent}; "
                       "run `cellmesh demo` from a clone of the cellmesh repository")


def run_demo_job(options: RunOptions, out: TextIO | None = None) -> RunResult:
    """``cellmesh demo``: :func:`run_job` on ``options`` (the charlm job), then a sample of its text."""
    out = out or sys.stdout
    result = run_job(options, out)
    generate = getattr(result.loaded.module, "generate", None)
    if callable(generate):
        model = result.loaded.job.build_model()
        model.load_state_dict(result.fit.state_dict, strict=True)
        text = generate(model, "The ", 160)
        print("\nthe trained model continues 'The ':\n\n" + str(text) + "\n", file=out, flush=True)
    return result
