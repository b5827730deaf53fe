"""Factory resolution: the one place where a ``"package.module:function"`` name becomes an object.

A job names its factories (the model, the data, the loss, the held-out data: every section of
its spec with a ``factory`` key; and the ``eval`` section's ``metric``); code is never
shipped. Two kinds of caller turn names into objects:

* the coordinator, for the job config it was given (``coordinator/runtime/factories.py``):
  :func:`resolve`;
* a worker, for the names that arrive in ``assign`` messages: :meth:`FactoryAllowList.resolve`,
  which refuses every name that is not one of the factories of the job spec the worker was
  started with, before anything is imported. Whoever sends the message (the coordinator's
  key included), the worker builds only its own job's factories.

[Note: what a factory may be]
Every name is checked in this order; each refusal is a :class:`FactoryError` naming the
factory and the fix:

1. the form ``package.module:attribute`` with identifiers only, and no part starting with
   ``__`` (no ``__builtins__``, no ``__class__``);
2. (a worker) the name is one of the job's factories (:class:`FactoryAllowList`);
3. the module is not the standard library's (``os:system``, ``subprocess:run``,
   ``builtins:eval``, ``shutil:rmtree``, ``importlib:import_module`` are never factories,
   even when a job spec lists them): refused before importing;
4. the module is imported and the attributes are looked up inside it; an attribute that is
   itself a module is refused (``charlm:os.system``: a factory is named by its own module);
5. the object is callable, and if it is a function or a class, it was not defined in the
   standard library (``charlm:system`` after ``from os import system`` in ``charlm``).

Rules 3 to 5 hold for the coordinator's own config too: defense in depth, not a sandbox. A
job's own modules run whatever they contain when imported; the allow-list decides *which*
modules and functions a worker touches, not what they do.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
import types
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

__all__ = ["FactoryAllowList", "FactoryError", "check_name", "factories_in_spec", "resolve", "spec_factories"]

_IDENTIFIER = r"[A-Za-z_]\w*"
_NAME = re.compile(rf"{_IDENTIFIER}(\.{_IDENTIFIER})*:{_IDENTIFIER}(\.{_IDENTIFIER})*")
_STDLIB = frozenset(sys.stdlib_module_names)
# the keys besides ``factory`` that name a factory, by section: exactly these, no pattern (an allow-list
# grows only by a name written here)
_MORE_FACTORIES: dict[str, tuple[str, ...]] = {"eval": ("metric",)}


class FactoryError(ValueError):
    """A factory name is malformed, not allowed, or does not resolve; the message names it and the fix."""


def check_name(name: str, *, what: str) -> tuple[str, list[str]]:
    """The module and attribute path of ``name``, once its form and its module pass rules 1 and 3.

    Raises:
        FactoryError: ``name`` is not ``package.module:attribute``, has a ``__`` part, or names a
            module of the standard library.
    """
    if not _NAME.fullmatch(name):
        raise FactoryError(f"{what} {name!r}: expected 'package.module:function' (identifiers only)")
    module, _, attr = name.partition(":")
    parts = [*module.split("."), *attr.split(".")]
    if any(p.startswith("__") for p in parts):
        raise FactoryError(f"{what} {name!r}: a part starts with '__'; name the factory itself "
                           "(a module-level function or class)")
    if module.split(".")[0] in _STDLIB:
        raise FactoryError(f"{what} {name!r}: {module!r} is part of Python's standard library, which holds "
                           "no factories; name a function of the job's own modules (or a library's "
                           "model class, as torch.nn:MSELoss)")
    return module, attr.split(".")


def _defined_in_stdlib(obj: Any) -> str | None:
    """The standard-library module that defined ``obj`` (a function or class), else None."""
    if not (inspect.isroutine(obj) or inspect.isclass(obj)):
        return None
    module = getattr(obj, "__module__", None)
    if isinstance(module, str) and module.split(".")[0] in _STDLIB:
        return module
    return None


def resolve(name: str, *, what: str) -> Any:
    """The callable ``name`` stands for, checked by [Note: what a factory may be] (rules 1, 3-5).

    Raises:
        FactoryError: The name breaks a rule, its module does not import, or lacks the attribute.
    """
    module_name, attrs = check_name(name, what=what)
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:
        raise FactoryError(f"{what} {name!r}: cannot import {module_name!r}: {type(exc).__name__}: {exc}"
                           ) from exc
    for i, part in enumerate(attrs):
        if not hasattr(obj, part):
            raise FactoryError(f"{what} {name!r}: {module_name!r} has no attribute {'.'.join(attrs)!r}")
        obj = getattr(obj, part)
        if isinstance(obj, types.ModuleType):
            inner = ".".join(attrs[: i + 1])
            raise FactoryError(f"{what} {name!r}: {inner!r} is a module imported by {module_name!r}; name "
                               f"the factory by its own module ('{obj.__name__}:...')")
    if not callable(obj):
        kind = type(obj).__name__
        raise FactoryError(f"{what} {name!r} is not callable ({'an' if kind[0] in 'aeiou' else 'a'} {kind}); "
                           "name a function or class")
    stdlib = _defined_in_stdlib(obj)
    if stdlib is not None:
        raise FactoryError(f"{what} {name!r} is {stdlib}.{getattr(obj, '__qualname__', '?')} of Python's "
                           "standard library, not a factory; name a function defined in the job's modules")
    return obj


def factories_in_spec(spec: Mapping[str, Any]) -> list[str]:
    """Every factory a job spec names: each top-level section's ``factory``, and the ``eval`` section's
    ``metric`` (sorted, once each).

    Works on the raw mapping (a spec file as read, or ``JobConfig.model_dump()``), so a worker
    needs no more of the config than this.
    """
    found = {section[key] for name, section in spec.items() if isinstance(section, Mapping)
             for key in ("factory", *_MORE_FACTORIES.get(name, ())) if isinstance(section.get(key), str)}
    return sorted(found)


def spec_factories(path: Path) -> list[str]:
    """The factories of the job spec file at ``path`` (YAML or JSON, as ``cellmesh run`` reads it).

    Raises:
        FactoryError: The file cannot be read, is not a mapping, or names no factory.
    """
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise FactoryError(f"job spec {path}: cannot read it ({exc})") from None
    if not isinstance(raw, Mapping):
        raise FactoryError(f"job spec {path}: expected a mapping of sections, got {type(raw).__name__}")
    names = factories_in_spec(raw)
    if not names:
        raise FactoryError(f"job spec {path} names no factory (no section has a 'factory' key)")
    return names


@dataclass(frozen=True)
class FactoryAllowList:
    """The factories a worker may build: those of the job it was started for.

    Attributes:
        names: The allowed ``"package.module:function"`` names, exactly.
        source: Where they came from, for messages (``"the job spec /etc/cellmesh/job.yaml"``).
    """

    names: frozenset[str]
    source: str

    @classmethod
    def of(cls, names: Iterable[str], source: str) -> FactoryAllowList:
        """An allow-list of ``names``, each checked for form and module (rules 1 and 3) now.

        Raises:
            FactoryError: A name is malformed or names the standard library.
        """
        listed = frozenset(names)
        for name in sorted(listed):
            check_name(name, what=f"factory of {source}")
        return cls(listed, source)

    def require(self, named: Mapping[str, str]) -> None:
        """Refuse, before importing anything, unless every name of ``named`` (what -> name) is allowed.

        Raises:
            FactoryError: Naming the first name that is not one of the job's factories.
        """
        for what, name in named.items():
            if name not in self.names:
                allowed = ", ".join(sorted(self.names)) or "none"
                raise FactoryError(f"{what} {name!r} is not a factory of this worker's job (allowed: "
                                   f"{allowed}; from {self.source}); start the worker with the job's spec "
                                   "(--job-spec) or its factories (--factory)")

    def resolve(self, name: str, *, what: str) -> Any:
        """:func:`resolve` of ``name`` once :meth:`require` allowed it.

        Raises:
            FactoryError: ``name`` is not allowed, or breaks a rule of :func:`resolve`.
        """
        self.require({what: name})
        return resolve(name, what=what)
