"""What ``cellmesh run JOB`` accepts: a YAML or JSON job spec, or a Python module exposing ``job()``.

A **job spec** (:class:`JobSpec`) is a strict pydantic model (``extra="forbid"``: a
misspelt field is an error, not a silent default) naming the factories, the optimizer,
the global batch, the steps and any plan fields to fix::

    # tiny.yaml
    model: mypkg.models:mlp          # "package.module:function", imported by every worker
    data: mypkg.models:regression
    loss: torch.nn:MSELoss
    optimizer: SGD                   # a torch.optim class name
    optimizer_kwargs: {lr: 0.1}
    global_batch: 16
    steps: 100
    workers: 2
    strategy: auto                   # or data_parallel / pipeline; fix fields below if wanted
    num_stages: 2

A **job module** (``examples/charlm.py``) exposes ``job()`` returning a
:class:`~coordinator.runtime.job.Job` or a :class:`JobSpec`, and optionally ``STEPS`` (the default
step count when ``job()`` returns a ``Job``). Its factories may be its own module-level
functions.

[Note: where factories are imported from]
The coordinator and every worker resolve factory names against the same path: the
current directory, then the job's *root*. For a spec file the root is the file's
directory. For a module file it is the first ancestor directory without an
``__init__.py``, and the module is imported under its dotted name from there
(``examples/charlm.py`` -> ``charlm``; ``pkg/jobs/a.py`` with ``pkg/__init__.py`` and
``pkg/jobs/__init__.py`` -> ``pkg.jobs.a``), so a worker importing ``charlm:model`` gets
the same function. The root, then the current directory, are prepended to this process's
``sys.path`` and to ``PYTHONPATH``, which the local harness hands its workers.

Command-line overrides (:class:`Overrides`) replace the spec's fields; on a ``Job`` from a
module they replace its resources (``Resources.local(workers)``) and plan fields.
Every failure to load is a :class:`JobSpecError` whose message is one paragraph.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import traceback
from dataclasses import dataclass, fields
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from coordinator.planning.plan import Mode
from coordinator.planning.planner import Strategy
from coordinator.planning.resources import Resources
from coordinator.runtime.job import Job
from services.protocol import FactoryKwargs

__all__ = ["DEFAULT_STEPS", "JobSpec", "JobSpecError", "LoadedJob", "Overrides", "load_job"]

DEFAULT_STEPS = 100
FactoryName = str
OptimizerKwargs = dict[str, float | int | bool | list[float]]
SPEC_SUFFIXES = {".yaml": "YAML", ".yml": "YAML", ".json": "JSON"}


def _default_lr() -> OptimizerKwargs:
    return {"lr": 0.01}


class JobSpecError(ValueError):
    """The job cannot be loaded: the message says which file, what is wrong and how to fix it."""


class JobSpec(BaseModel):
    """A job for the command line: factories by name, optimizer, batch, steps, plan fields.

    Attributes:
        version: The spec format (1).
        name: The job's name (registry prefix, output file name); the file's stem by default.
        model, data, loss: Factories as ``"package.module:function"``.
        model_kwargs, data_kwargs, loss_kwargs: Their keyword arguments (plain values).
        optimizer: A ``torch.optim`` class name; ``optimizer_kwargs`` its arguments.
        global_batch: Samples per step over all replicas.
        steps: Steps to train.
        workers: Local worker processes.
        strategy, data_parallel, num_stages, mode, schedule, num_microbatches, balance:
            Plan fields to fix (see :func:`coordinator.planning.planner.choose_plan`).
        seed, shuffle, num_samples, comm_backend: As :class:`~coordinator.runtime.job.Job` takes them.
        step_timeout_s: Bounds each round of a step, in seconds.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: Literal[1] = 1
    name: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.-]+$")
    model: FactoryName = Field(pattern=r"^[\w.]+:[\w.]+$")
    data: FactoryName = Field(pattern=r"^[\w.]+:[\w.]+$")
    loss: FactoryName = Field(pattern=r"^[\w.]+:[\w.]+$")
    model_kwargs: FactoryKwargs = Field(default_factory=dict)
    data_kwargs: FactoryKwargs = Field(default_factory=dict)
    loss_kwargs: FactoryKwargs = Field(default_factory=dict)
    optimizer: str = "SGD"
    optimizer_kwargs: OptimizerKwargs = Field(default_factory=lambda: _default_lr())
    global_batch: int = Field(default=32, ge=1)
    steps: int = Field(default=DEFAULT_STEPS, ge=0)
    workers: int = Field(default=2, ge=1)
    strategy: Strategy = "auto"
    data_parallel: int | None = Field(default=None, ge=1)
    num_stages: int | None = Field(default=None, ge=1)
    mode: Mode | None = None
    schedule: str | None = None
    num_microbatches: int | None = Field(default=None, ge=1)
    balance: list[int] | None = None
    seed: int = 0
    shuffle: bool = True
    num_samples: int | None = Field(default=None, ge=1)
    comm_backend: Literal["zmq", "gloo"] = "zmq"
    step_timeout_s: float = Field(default=300.0, gt=0)

    def to_job(self) -> Job:
        """The :class:`Job` this spec describes.

        Raises:
            ValueError: A factory does not import, or the optimizer is not a ``torch.optim`` class.
        """
        return Job(model=self.model, data=self.data, loss=self.loss, optimizer=self.optimizer,
                   optimizer_kwargs=dict(self.optimizer_kwargs), resources=Resources.local(self.workers),
                   global_batch=self.global_batch, strategy=self.strategy, data_parallel=self.data_parallel,
                   num_stages=self.num_stages, mode=self.mode, schedule=self.schedule,
                   num_microbatches=self.num_microbatches, balance=self.balance,
                   model_kwargs=dict(self.model_kwargs), data_kwargs=dict(self.data_kwargs),
                   loss_kwargs=dict(self.loss_kwargs), seed=self.seed, shuffle=self.shuffle,
                   num_samples=self.num_samples, name=self.name, comm_backend=self.comm_backend,
                   step_timeout=timedelta(seconds=self.step_timeout_s))


@dataclass(frozen=True)
class Overrides:
    """Fields the command line sets over the job's own (None leaves the job's value)."""

    workers: int | None = None
    steps: int | None = None
    strategy: Strategy | None = None
    data_parallel: int | None = None
    num_stages: int | None = None
    mode: Mode | None = None
    schedule: str | None = None
    num_microbatches: int | None = None

    def given(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


@dataclass
class LoadedJob:
    """A job ready to plan and fit, with its step count and where it came from.

    Attributes:
        job: The job (overrides applied).
        steps: How many steps to train.
        name: A short name for output files (the spec's name or the file's stem).
        source: ``"job spec tiny.yaml"`` or ``"job module charlm (examples/charlm.py)"``.
        module: The imported job module (None for a spec file).
    """

    job: Job
    steps: int
    name: str
    source: str
    module: ModuleType | None = None


def load_job(path: str | os.PathLike[str], overrides: Overrides | None = None) -> LoadedJob:
    """Load a job spec (``.yaml``/``.yml``/``.json``) or a job module (``.py``); apply ``overrides``.

    Raises:
        JobSpecError: The file is missing, malformed, invalid, names a factory that does not
            import, or (a module) fails to import or has no usable ``job()``.
    """
    file = Path(path)
    overrides = overrides or Overrides()
    if not file.is_file():
        raise JobSpecError(f"job file {str(path)!r} does not exist (give a job module .py or a job spec "
                           f"{'/'.join(SPEC_SUFFIXES)} file)")
    if file.suffix == ".py":
        root, name = module_name(file)
        _use_path(root)
        _use_path(Path.cwd())
        return _load_module(file, name, overrides)
    if file.suffix in SPEC_SUFFIXES:
        _use_path(file.resolve().parent)
        _use_path(Path.cwd())
        spec = _apply(read_spec(file), overrides, where=f"job spec {file}")
        return LoadedJob(_job_of(spec, f"job spec {file}"), spec.steps, spec.name or file.stem,
                         f"job spec {file}")
    raise JobSpecError(f"job file {str(file)!r}: unknown kind {file.suffix!r}; give a job module (.py) or a "
                       f"job spec ({', '.join(SPEC_SUFFIXES)})")


def read_spec(file: Path) -> JobSpec:
    """Parse and validate a YAML or JSON job spec.

    Raises:
        JobSpecError: The file does not parse, or is not a valid :class:`JobSpec`.
    """
    kind = SPEC_SUFFIXES[file.suffix]
    try:
        with file.open(encoding="utf-8") as f:  # YAML errors then name the file
            raw = yaml.safe_load(f) if kind == "YAML" else json.load(f)
    except (OSError, UnicodeDecodeError, yaml.YAMLError, json.JSONDecodeError) as exc:
        raise JobSpecError(f"job spec {file} is not valid {kind}: {_one_line(str(exc))}") from exc
    if not isinstance(raw, dict):
        raise JobSpecError(f"job spec {file} must hold a mapping of fields (model, data, loss, ...), "
                           f"not a {type(raw).__name__}")
    try:
        return JobSpec.model_validate(raw)
    except ValidationError as exc:
        raise JobSpecError(f"job spec {file} is invalid: {describe_validation(exc, raw)}") from exc


def describe_validation(exc: ValidationError, raw: Any) -> str:
    """A pydantic error about ``raw`` as one ``field 'x': what is wrong`` per field, joined by ``"; "``.

    A value matching no member of a union (``lr: fast``) gives one entry naming the members.
    """
    problems: dict[str, list[tuple[str, str, str, Any]]] = {}  # field -> (type, message, union tag, input)
    for err in exc.errors():
        loc = tuple(err["loc"])
        path, tags = _walk(raw, loc) if err["type"] not in ("missing", "extra_forbidden") else (loc, ())
        where = ".".join(str(p) for p in path) or "the spec"
        tag = ".".join(str(t) for t in tags)
        problems.setdefault(where, []).append((err["type"], err["msg"], tag, err.get("input")))
    parts = []
    for where, errs in problems.items():
        kind, msg, _, value = errs[0]
        if kind == "extra_forbidden":
            parts.append(f"field {where!r}: unknown field (misspelt?)")
        elif kind == "missing":
            parts.append(f"field {where!r}: missing (required)")
        elif len(errs) > 1:
            members = ", ".join(tag for _, _, tag, _ in errs if tag)
            parts.append(f"field {where!r}: {_short(value)} is none of the accepted types ({members})")
        else:
            parts.append(f"field {where!r}: {msg} (got {_short(value)})")
    return "; ".join(parts)


def _walk(raw: Any, loc: tuple[Any, ...]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """Split an error location into the path present in ``raw`` and the union tags after it."""
    node = raw
    for i, part in enumerate(loc):
        present = (part in node if isinstance(node, dict)
                   else isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node))
        if present:
            node = node[part]
        else:
            return loc[:i], loc[i:]
    return loc, ()


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _apply(spec: JobSpec, overrides: Overrides, *, where: str) -> JobSpec:
    raw = {**spec.model_dump(), **overrides.given()}
    try:
        return JobSpec.model_validate(raw)
    except ValidationError as exc:
        raise JobSpecError(f"{where} with the command line's options is invalid: "
                           f"{describe_validation(exc, raw)}") from exc


def _job_of(spec: JobSpec, where: str) -> Job:
    try:
        return spec.to_job()
    except ValueError as exc:
        raise JobSpecError(f"{where}: {exc}") from exc


def _use_path(directory: Path) -> None:
    """Put ``directory`` first on this process's ``sys.path`` and the workers' ``PYTHONPATH``.

    A directory already on ``sys.path`` stays where it is.
    """
    entry = str(directory)
    if entry not in sys.path:
        sys.path.insert(0, entry)
    current = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if entry not in current:
        os.environ["PYTHONPATH"] = os.pathsep.join([entry, *current])


def module_name(file: Path) -> tuple[Path, str]:
    """``(root, dotted name)`` of a module file (see [Note: where factories are imported from])."""
    file = file.resolve()
    parts = [file.stem]
    root = file.parent
    while (root / "__init__.py").is_file() and root.parent != root:
        parts.insert(0, root.name)
        root = root.parent
    return root, ".".join(parts)


def _load_module(file: Path, name: str, overrides: Overrides) -> LoadedJob:
    where = f"job module {name} ({file})"
    if not all(part.isidentifier() for part in name.split(".")):
        raise JobSpecError(f"{where}: {name!r} is not an importable module name; rename the file to a "
                           "Python identifier (letters, digits, underscores)")
    try:
        module = importlib.import_module(name)
    except Exception as exc:
        raise JobSpecError(f"{where} failed to import: {_located(exc)}") from exc
    origin = getattr(module, "__file__", None)
    if origin is None or Path(origin).resolve() != file.resolve():
        raise JobSpecError(f"{where}: the name {name!r} is taken by another module ({origin or 'built in'}); "
                           "rename the job file so the workers import the same module")
    make = getattr(module, "job", None)
    if not callable(make):
        raise JobSpecError(f"{where} has no job() function; a job module defines job() returning a "
                           "coordinator.runtime.job.Job or a coordinator.commands.jobspec.JobSpec")
    try:
        made = make()
    except Exception as exc:
        raise JobSpecError(f"{where}: job() raised {_located(exc)}") from exc
    if isinstance(made, JobSpec):
        spec = _apply(made, overrides, where=where)
        return LoadedJob(_job_of(spec, where), spec.steps, spec.name or file.stem, where, module)
    if not isinstance(made, Job):
        raise JobSpecError(f"{where}: job() returned {_short(made)} ({type(made).__name__}), not a "
                           "coordinator.runtime.job.Job or a coordinator.commands.jobspec.JobSpec")
    steps = getattr(module, "STEPS", DEFAULT_STEPS)
    if not isinstance(steps, int) or steps < 0:
        raise JobSpecError(f"{where}: STEPS must be a non-negative int, got {steps!r}")
    override(made, overrides)
    if overrides.steps is not None:
        steps = overrides.steps
    return LoadedJob(made, steps, file.stem, where, module)


def override(job: Job, overrides: Overrides) -> None:
    """Apply ``overrides`` to a job that has not planned yet: local workers and plan fields."""
    if overrides.workers is not None:
        job.resources = Resources.local(overrides.workers)
    plan_fields = {k: v for k, v in overrides.given().items() if k not in ("workers", "steps")}
    job.plan_fields.update(plan_fields)


def _located(exc: BaseException) -> str:
    """``Type: message (at file:line)``: the innermost frame, for errors in a user's code."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    if isinstance(exc, SyntaxError) and exc.filename:
        where = f" (at {exc.filename}:{exc.lineno})"
    return f"{type(exc).__name__}: {_one_line(str(exc))}{where}"


def _one_line(text: str) -> str:
    return " ".join(text.split())
