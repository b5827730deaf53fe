"""Every worker's planning fields as arrays, so a placement of 1,024 workers is read in a few numpy passes.

The planner places hundreds of shapes on a cluster-sized resource list; each placement asks how its
workers share their hosts' cores, which of a stage's replicas share a host, their slowest speed and least
memory. Asked worker by worker in Python that is a few passes over every worker per placement (a tenth
of a free search on 128 CPU hosts of 8 workers); over these columns it is a gather and a reduction.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from coordinator.planning.resources import Resources

__all__ = ["WorkerTable"]


@dataclass(frozen=True, eq=False)
class WorkerTable:
    """The workers of a resource list, one entry per worker in list order.

    Attributes:
        index: Worker name -> its position.
        host: Its host's number (hosts numbered in the order of their first worker), or ``-1 - i`` for
            worker ``i`` without a host (a host of its own).
        cpu: Whether it is a CPU worker.
        cpus: Its ``cpus``.
        speed: Its ``speed``.
        memory: Its ``memory_bytes``.
        cores_given: Whether its ``host_cpus`` is given.
        host_cores: Per host number, its cores (``Resources.host_cores``).
    """

    index: dict[str, int]
    host: np.ndarray
    cpu: np.ndarray
    cpus: np.ndarray
    speed: np.ndarray
    memory: np.ndarray
    cores_given: np.ndarray
    host_cores: np.ndarray

    @classmethod
    def of(cls, resources: Resources) -> WorkerTable:
        workers = resources.workers
        host_id = [resources.host_number(w.name) for w in workers]
        first: dict[int, str] = {}
        for h, w in zip(host_id, workers, strict=True):
            if h >= 0:
                first.setdefault(h, w.name)
        cores = np.zeros(len(first), dtype=np.int64)
        for h, name in first.items():
            cores[h] = resources.host_cores(name)
        return cls({w.name: i for i, w in enumerate(workers)}, np.array(host_id, dtype=np.int64),
                   np.array([w.device == "cpu" for w in workers], dtype=bool),
                   np.array([w.cpus for w in workers], dtype=np.float64),
                   np.array([w.speed for w in workers], dtype=np.float64),
                   np.array([w.memory_bytes for w in workers], dtype=np.int64),
                   np.array([w.host_cpus is not None for w in workers], dtype=bool), cores)

    def indices(self, names: Sequence[str]) -> np.ndarray:
        """The positions of ``names``.

        Raises:
            KeyError: On a name not in the list.
        """
        if not names:
            return np.zeros(0, dtype=np.int64)
        got = operator.itemgetter(*names)(self.index)
        return np.array(got if len(names) > 1 else (got,), dtype=np.int64)
