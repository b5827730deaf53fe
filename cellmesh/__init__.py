"""cellmesh: distributed training for PyTorch, as small stateless services under one coordinator.

The public API is this package's ``__all__``; everything else (``comm``, ``services``,
``coordinator``) is internal and may change. Names load on first use, so ``import
cellmesh`` (and the ``cellmesh`` command's ``--help``) costs no torch import::

    import cellmesh

    job = cellmesh.Job(model="mypackage.model:build", loss="mypackage.model:loss",
                       data="mypackage.data:samples", resources=cellmesh.Resources.local(workers=2))
    result = job.fit(steps=100)

``cellmesh.Job(config)`` takes a whole :class:`JobConfig` instead (what a job spec file holds);
its keyword fields are that config's, by name (docs/running.md).
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from comm.errors import CommError, CommTimeoutError, PeerLostError, RegistryError
    from coordinator.planning.config import ConfigError, JobConfig
    from coordinator.planning.cutting import CutError
    from coordinator.planning.plan import Plan
    from coordinator.planning.request import PlanningError
    from coordinator.planning.resources import Link, Resources, Worker
    from coordinator.runtime.errors import JobError, JobFailed
    from coordinator.runtime.job import FitResult, Job
    from coordinator.runtime.nonfinite import NonFiniteStep
    from services.compute.actions import ScheduleError
    from services.compute.cell import Cell, as_cells
    from services.compute.library import (
        MLP,
        ClassifierHead,
        ConvBlock,
        Dropout,
        LMHead,
        Norm,
        ResidualBlock,
        TokenEmbedding,
        TransformerBlock,
    )
    from services.compute.randomness import reproducible

# name -> the module that defines it; imported on first access (PEP 562).
_EXPORTS: dict[str, str] = {
    "Job": "coordinator.runtime.job",
    "JobConfig": "coordinator.planning.config",
    "FitResult": "coordinator.runtime.job",
    "Resources": "coordinator.planning.resources",
    "Worker": "coordinator.planning.resources",
    "Link": "coordinator.planning.resources",
    "Plan": "coordinator.planning.plan",
    "Cell": "services.compute.cell",
    "as_cells": "services.compute.cell",
    "reproducible": "services.compute.randomness",  # a user's loop draws what a cellmesh run draws
    # ready-made cells (services/compute/library)
    "MLP": "services.compute.library",
    "Norm": "services.compute.library",
    "Dropout": "services.compute.library",
    "TokenEmbedding": "services.compute.library",
    "TransformerBlock": "services.compute.library",
    "LMHead": "services.compute.library",
    "ConvBlock": "services.compute.library",
    "ResidualBlock": "services.compute.library",
    "ClassifierHead": "services.compute.library",
    # errors
    "JobFailed": "coordinator.runtime.errors",
    "JobError": "coordinator.runtime.errors",
    "NonFiniteStep": "coordinator.runtime.nonfinite",
    "ConfigError": "coordinator.planning.config",
    "PlanningError": "coordinator.planning.request",
    "CutError": "coordinator.planning.cutting",
    "ScheduleError": "services.compute.actions",
    "CommError": "comm.errors",
    "CommTimeoutError": "comm.errors",
    "PeerLostError": "comm.errors",
    "RegistryError": "comm.errors",
}

try:
    __version__ = version("cellmesh")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "MLP",
    "Cell",
    "ClassifierHead",
    "CommError",
    "CommTimeoutError",
    "ConfigError",
    "ConvBlock",
    "CutError",
    "Dropout",
    "FitResult",
    "Job",
    "JobConfig",
    "JobError",
    "JobFailed",
    "LMHead",
    "Link",
    "NonFiniteStep",
    "Norm",
    "PeerLostError",
    "Plan",
    "PlanningError",
    "RegistryError",
    "ResidualBlock",
    "Resources",
    "ScheduleError",
    "TokenEmbedding",
    "TransformerBlock",
    "Worker",
    "__version__",
    "as_cells",
    "reproducible",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'cellmesh' has no attribute {name!r}; the public names are "
                             f"{', '.join(sorted(_EXPORTS))}")
    value = getattr(importlib.import_module(module), name)  # an ImportError here is real: let it show
    globals()[name] = value  # later accesses skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
