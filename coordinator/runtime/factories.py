"""Importable factories: what a job names so that workers build the model, the data and the loss.

Workers never receive code: a job names each factory as ``"package.module:function"``. A
user may pass the function object instead; :func:`factory_path` turns it into that name
and checks it resolves to the same object (so a lambda, a nested function or a function
defined in ``__main__`` is refused with the fix). Names resolve through
``services/factories.py``, as on the workers (the same rules: never the standard library,
never through another module). The builders here run the factories in the coordinator's
process exactly as a worker's stage does (``services/compute/stage.py``): seeded in a
forked RNG, so the coordinator's copy of the model has the parameters every worker builds.
A worker builds only the factories of its job: :func:`job_factories` is the list a local
run's workers are started with.

[Note: where a job's modules are found] A job's own modules live in its ``code_dir`` (the
config's ``runtime.code_dir``; ``cellmesh run`` sets it to the job file's directory). The
coordinator imports a job's factories once, when the ``Job`` is made, inside
:func:`job_imports`: for that import only, the current directory then ``code_dir`` come
first on ``sys.path``; afterwards ``sys.path`` is as it was and the imported modules stay in
``sys.modules``, so later lookups of the same names (building the model, the reference)
find them. A local worker gets ``code_dir`` on its ``PYTHONPATH`` from the harness; as
``python -m services.host.worker`` it has the current directory first on its path: both
processes resolve a name to the same file. Workers started elsewhere (pods) find the
factories on their own ``PYTHONPATH``.

A module the coordinator imported from a directory it put on ``sys.path`` itself (a notebook's
``sys.path.append``, a script's own folder) is found by a local worker too: as
``multiprocessing``'s spawn hands a child its parent's ``sys.path``, a local run puts the
directory each factory's top-level module came from on its workers' path
(:func:`factory_roots`); the interpreter's own directories are left out, since every worker has
them.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from coordinator.planning.config import JobConfig
from coordinator.runtime.errors import JobError, located
from services.compute.cell import as_cells
from services.compute.chain import Chain, is_cell_sequence, trace_chain
from services.compute.stage import SampleError, SampleSource
from services.factories import factories_in_spec, resolve

__all__ = ["FactoryRef", "build_chain", "build_data", "build_loss", "build_metric", "build_model", "chain_of",
           "factory_path", "factory_roots", "job_factories", "job_imports", "made_by", "seeded", "unwrapped"]

FactoryRef = str | Callable[..., Any]


@contextmanager
def job_imports(code_dir: str | os.PathLike[str] | None) -> Iterator[None]:
    """Inside, the current directory then ``code_dir`` come first on ``sys.path`` (None: nothing changes).

    See [Note: where a job's modules are found]. The two entries are removed on the way out;
    what the imports added to ``sys.modules`` stays.
    """
    if code_dir is None:
        yield
        return
    entries = [os.getcwd(), str(Path(code_dir).resolve())]
    sys.path[:0] = entries
    importlib.invalidate_caches()  # a module written since the last import is found
    try:
        yield
    finally:
        for entry in entries:
            if entry in sys.path:
                sys.path.remove(entry)


def factory_path(ref: FactoryRef, *, what: str, code_dir: str | None = None) -> str:
    """The ``"package.module:function"`` name of ``ref`` (a name or a module-level function).

    A name is imported now (looked for in ``code_dir`` too, see :func:`job_imports`), so a factory
    that does not import fails in the caller's process with the reason.

    Raises:
        ValueError: ``ref`` is malformed, does not import, or is not importable by name
            (a lambda, a nested function, something defined in ``__main__``).
    """
    if isinstance(ref, str):
        with job_imports(code_dir):
            resolve(ref, what=what)
        return ref
    module = getattr(ref, "__module__", None)
    qualname = getattr(ref, "__qualname__", None)
    if not module or not qualname or module == "__main__" or "<" in qualname:
        raise ValueError(f"{what} {ref!r} cannot be imported by name by the workers: define it at module "
                         "level in an importable module (not __main__, not a lambda or nested function) "
                         "or pass its 'package.module:function' name")
    path = f"{module}:{qualname}"
    if resolve(path, what=what) is not ref:
        raise ValueError(f"{what} {path!r} does not resolve to the object given; pass its name instead")
    return path


def factory_roots(factories: Sequence[str]) -> list[str]:
    """The directories the top-level modules of ``factories`` were imported from, outside the interpreter's
    own (``sys.prefix``, ``sys.base_prefix``): what a local worker needs on its path to import them as
    this process did. A factory whose module is not imported here (yet) adds nothing."""
    own = {str(Path(p).resolve()) for p in {sys.prefix, sys.base_prefix, sys.exec_prefix}}
    roots: list[str] = []
    for name in factories:
        top = name.partition(":")[0].partition(".")[0]
        module = sys.modules.get(top)
        where = getattr(module, "__file__", None)
        if module is None or where is None:
            continue
        path = Path(where).resolve()
        root = path.parent.parent if path.name == "__init__.py" else path.parent
        text = str(root)
        if not any(text == p or text.startswith(p + os.sep) for p in own) and text not in roots:
            roots.append(text)
    return roots


def job_factories(config: JobConfig) -> list[str]:
    """The factories ``config`` names (model, data, loss, eval and its metric): all its workers may build."""
    return factories_in_spec(config.model_dump())


def seeded(seed: int, fn: Callable[[], Any]) -> Any:
    """``fn()`` under ``torch.manual_seed(seed)`` in a forked RNG (as ``services.compute.stage`` builds)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return fn()


def unwrapped(made: Any) -> nn.Module:
    """The model a factory's result stands for: the module itself, or ``nn.Sequential`` of a sequence.

    This is the module whose ``state_dict`` a job's result loads into with ``strict=True``.
    """
    return made if isinstance(made, nn.Module) else nn.Sequential(*made)


def made_by(path: str, what: str, make: Callable[[], Any]) -> Any:
    """``make()`` (a call of the factory ``path``); what it raises becomes a :class:`JobError` naming it.

    ``what`` is the config section (``"model"``, ``"data"``, ``"loss"``): the message points at
    its factory and its ``kwargs``, and at the line of the user's code that raised.
    """
    try:
        return make()
    except Exception as exc:
        raise JobError(f"{what} factory {path!r} raised {located(exc)}; fix the factory or "
                       f"{what}.kwargs") from exc


def build_model(path: str, kwargs: Mapping[str, Any], seed: int) -> Any:
    """What the model factory returns (a module, or a sequence of modules or cells), built as a worker does.

    Raises:
        ValueError: The factory does not import.
        JobError: The factory raised.
    """
    factory = resolve(path, what="model factory")
    return made_by(path, "model", lambda: seeded(seed, lambda: factory(**kwargs)))


def build_chain(path: str, kwargs: Mapping[str, Any], seed: int,
                leaves: Sequence[str]) -> tuple[nn.Module, Chain]:
    """The unwrapped model and its chain of nodes (sharing parameters), built and traced as a worker does.

    Raises:
        ValueError: The factory does not import.
        JobError: The factory raised, or its result is not a model torch.fx traces.
    """
    made = build_model(path, kwargs, seed)
    return unwrapped(made), chain_of(path, made, leaves)


def chain_of(path: str, made: Any, leaves: Sequence[str]) -> Chain:
    """The chain of nodes of what the model factory ``path`` returned, traced with ``leaves`` (model.leaves).

    Raises:
        JobError: It is not a module or a sequence of modules, its cell names repeat, torch.fx
            cannot trace it (naming the submodule and the fix), or a leaf names no submodule.
    """
    if is_cell_sequence(made):
        try:
            as_cells(made)
        except (ValueError, TypeError) as exc:
            raise JobError(f"model factory {path!r} returned {type(made).__name__}: {exc}; return a module "
                           "or a list of modules or Cells") from None
    try:
        return trace_chain(made, leaves)
    except ValueError as exc:  # untraceable (services.compute.chain.UntraceableError) or a bad leaf
        raise JobError(f"model factory {path!r}: {exc}") from None


def build_data(path: str, kwargs: Mapping[str, Any], seed: int, *, section: str = "data") -> SampleSource:
    """The job's samples (``section="eval"``: its held-out samples), seeded as the workers' are.

    Raises:
        ValueError: The factory does not import.
        JobError: The factory raised, or returned neither a pair nor a loader, or inputs and
            targets of different lengths.
    """
    data = resolve(path, what=f"{section} factory")
    made = made_by(path, section, lambda: seeded(seed, lambda: data(**kwargs)))
    try:
        return SampleSource(made, what=f"{section} factory {path!r}")
    except SampleError as exc:
        raise JobError(str(exc)) from None


def build_loss(path: str, kwargs: Mapping[str, Any]) -> Callable[[Any, Any], torch.Tensor]:
    """``loss(output, targets)`` from the loss factory.

    Raises:
        ValueError: The factory does not import.
        JobError: The factory raised or returned something not callable.
    """
    factory = resolve(path, what="loss factory")
    made = made_by(path, "loss", lambda: factory(**kwargs))
    if not callable(made):
        raise JobError(f"loss factory {path!r} returned a {type(made).__name__}, not a callable "
                       "loss(output, targets)")
    fn: Callable[[Any, Any], torch.Tensor] = made
    return fn


def build_metric(path: str) -> Callable[[Any, Any], torch.Tensor]:
    """``metric(output, targets)`` from the eval section's metric factory (called without arguments).

    Raises:
        ValueError: The factory does not import.
        JobError: The factory raised or returned something not callable.
    """
    factory = resolve(path, what="eval metric factory")
    try:
        made = factory()
    except Exception as exc:
        raise JobError(f"eval metric factory {path!r} raised {located(exc)}; fix the factory (it is called "
                       "without arguments and returns metric(output, targets))") from exc
    if not callable(made):
        raise JobError(f"eval metric factory {path!r} returned a {type(made).__name__}, not a callable "
                       "metric(output, targets)")
    fn: Callable[[Any, Any], torch.Tensor] = made
    return fn
