"""What ``cellmesh run JOB`` accepts: a job spec file (YAML or JSON) or a job module exposing ``job()``.

A **job spec** is a job config (:class:`~coordinator.planning.config.JobConfig`) written as
YAML or JSON: sections of fields, strict (a misspelt key is an error naming it)::

    # tiny.yaml
    version: 2
    model: {factory: mypkg.models:mlp, kwargs: {hidden: 64}}
    data: {factory: mypkg.models:regression, global_batch: 16}
    loss: {factory: torch.nn:MSELoss}
    optimizer: {name: SGD, kwargs: {lr: 0.1}}
    steps: 100
    plan: {num_stages: 2}            # fix any plan field; the planner chooses the rest
    runtime: {workers: 2}

A **job module** (``examples/charlm.py``) exposes ``job()`` returning a ``JobConfig``, or a
:class:`~coordinator.runtime.job.Job` made from one (its config is what runs: a ``Job`` given
its own ``resources=`` or ``plan=`` is refused). Its factories may be its own module-level
functions.

The command line's settings (dotted keys: ``{"plan.num_stages": 2}``) apply over the file's
config and are validated with it. Where the job's own modules are found is one rule, the
job file's directory: see :func:`load_job` and [Note: where a job's modules are found] in
``coordinator/runtime/factories.py``. Every failure to load is a :class:`JobSpecError`
whose message is one paragraph.

This module imports no torch at import time (``cellmesh k8s render`` and the command line's
parser read specs through it); :func:`load_job` imports the ``Job`` when it makes one.
"""

from __future__ import annotations

import importlib
import json
import os
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import yaml

from coordinator.planning.config import ConfigError, JobConfig, parse_config

if TYPE_CHECKING:
    from coordinator.runtime.job import Job

__all__ = ["SPEC_SUFFIXES", "JobSpecError", "LoadedJob", "load_job", "read_spec"]

SPEC_SUFFIXES = {".yaml": "YAML", ".yml": "YAML", ".json": "JSON"}
CODE_DIR = "runtime.code_dir"


class JobSpecError(ValueError):
    """The job cannot be loaded: the message says which file, what is wrong and how to fix it."""


@dataclass
class LoadedJob:
    """A job ready to plan and fit, and where it came from.

    Attributes:
        job: The job (the command line's settings applied).
        name: A short name for output files (the config's name or the file's stem).
        source: ``"job spec tiny.yaml"`` or ``"job module charlm (examples/charlm.py)"``.
        module: The imported job module (None for a spec file).
    """

    job: Job
    name: str
    source: str
    module: ModuleType | None = None

    @property
    def steps(self) -> int:
        """How many steps to train: the config's ``steps``."""
        return self.job.config.steps


def load_job(path: str | os.PathLike[str], settings: Mapping[str, Any] | None = None) -> LoadedJob:
    """Load a job spec (``.yaml``/``.yml``/``.json``) or a job module (``.py``); apply ``settings``.

    The job file's directory is where the job's own modules are found: it becomes the config's
    ``runtime.code_dir`` (a ``code_dir`` the file gives is relative to that directory, one
    the settings give to the current directory). A job module is imported by its file's stem
    from there (``examples/charlm.py`` is ``charlm``), as the workers import ``charlm:model``.

    Raises:
        JobSpecError: The file is missing, malformed, invalid (with or without the settings),
            names a factory that does not import, or (a module) fails to import or has no
            usable ``job()``.
    """
    file = Path(path)
    settings = dict(settings or {})
    if not file.is_file():
        raise JobSpecError(f"job file {str(path)!r} does not exist (give a job module .py or a job spec "
                           f"{'/'.join(SPEC_SUFFIXES)} file)")
    if file.suffix == ".py":
        return _load_module(file, settings)
    if file.suffix in SPEC_SUFFIXES:
        where = f"job spec {file}"
        config = _settled(read_spec(file), file, settings, where)
        return LoadedJob(_job_of(config, where), config.name or file.stem, where)
    raise JobSpecError(f"job file {str(file)!r}: unknown kind {file.suffix!r}; give a job module (.py) or a "
                       f"job spec ({', '.join(SPEC_SUFFIXES)})")


def read_spec(file: Path) -> JobConfig:
    """Parse and validate a YAML or JSON job spec, as the file says it (no settings, no ``code_dir`` rule).

    Raises:
        JobSpecError: The file does not parse, or is not a valid job config.
    """
    kind = SPEC_SUFFIXES[file.suffix]
    try:
        with file.open(encoding="utf-8") as f:  # YAML errors then name the file
            raw = yaml.safe_load(f) if kind == "YAML" else json.load(f)
    except (OSError, UnicodeDecodeError, yaml.YAMLError, json.JSONDecodeError) as exc:
        raise JobSpecError(f"job spec {file} is not valid {kind}: {_one_line(str(exc))}") from exc
    if not isinstance(raw, dict):
        raise JobSpecError(f"job spec {file} must hold a mapping of sections (model, data, loss, ...), "
                           f"not a {type(raw).__name__}")
    try:
        return parse_config(raw)
    except ConfigError as exc:
        raise JobSpecError(f"job spec {file} is invalid: {exc}") from exc


def _settled(config: JobConfig, file: Path, settings: dict[str, Any], where: str) -> JobConfig:
    """``config`` with the command line's ``settings`` and the ``code_dir`` rule (see :func:`load_job`).

    Raises:
        JobSpecError: The settings make the config invalid (naming the key).
    """
    own = file.resolve().parent / (config.runtime.code_dir or ".")
    given = settings.get(CODE_DIR)
    code_dir = Path(str(given)).resolve() if given is not None else own.resolve()
    try:
        return config.updated({**settings, CODE_DIR: str(code_dir)})
    except ConfigError as exc:
        raise JobSpecError(f"{where} with the command line's settings is invalid: {exc}") from exc


def _job_of(config: JobConfig, where: str) -> Job:
    from coordinator.runtime.job import Job  # torch: only once a job is made (see the module docstring)

    try:
        return Job(config)
    except ValueError as exc:
        raise JobSpecError(f"{where}: {_one_line(str(exc))}") from exc


def _load_module(file: Path, settings: dict[str, Any]) -> LoadedJob:
    from coordinator.runtime.devices import local_resources
    from coordinator.runtime.factories import job_imports
    from coordinator.runtime.job import Job

    name = file.stem
    where = f"job module {name} ({file})"
    if not name.isidentifier():
        raise JobSpecError(f"{where}: {name!r} is not an importable module name; rename the file to a "
                           "Python identifier (letters, digits, underscores)")
    with job_imports(file.parent):
        try:
            module = importlib.import_module(name)
        except Exception as exc:
            raise JobSpecError(f"{where} failed to import: {_located(exc)}") from exc
        origin = getattr(module, "__file__", None)
        if origin is None or Path(origin).resolve() != file.resolve():
            raise JobSpecError(f"{where}: the name {name!r} is taken by another module "
                               f"({origin or 'built in'}); rename the job file so the workers import "
                               "the same module")
        make = getattr(module, "job", None)
        if not callable(make):
            raise JobSpecError(f"{where} has no job() function; a job module defines job() returning a "
                               "JobConfig (coordinator.planning.config) or a Job (coordinator.runtime.job)")
        try:
            made = make()
        except Exception as exc:
            raise JobSpecError(f"{where}: job() raised {_located(exc)}") from exc
    if isinstance(made, Job):
        if made.fixed_plan is not None or made.resources != local_resources(made.config.runtime):
            raise JobSpecError(f"{where}: job() returned a Job with its own resources= or plan=, which a job "
                               "file does not carry; return the Job without them (runtime.workers sets the "
                               "local workers)")
        made = made.config
    if not isinstance(made, JobConfig):
        raise JobSpecError(f"{where}: job() returned {_short(made)} ({type(made).__name__}), not a JobConfig "
                           "(coordinator.planning.config) or a Job (coordinator.runtime.job)")
    config = _settled(made, file, settings, where)
    return LoadedJob(_job_of(config, where), config.name or name, where, module)


def _located(exc: BaseException) -> str:
    """``Type: message (at file:line)``: the innermost frame, for errors in a user's code."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    if isinstance(exc, SyntaxError) and exc.filename:
        where = f" (at {exc.filename}:{exc.lineno})"
    return f"{type(exc).__name__}: {_one_line(str(exc))}{where}"


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _one_line(text: str) -> str:
    return " ".join(text.split())
