"""The resource list: workers (CPU/GPU, memory, speed) and the links between them.

A :class:`Resources` is what a user hands the coordinator besides the model and the data.
It is a pydantic model (``extra="forbid"``) so it loads from JSON or a ConfigMap and is
checked on construction. :meth:`Resources.local` describes this machine split into ``N``
worker processes.

Bandwidth and latency follow [Note: transfer cost] in ``coordinator/planning/cutting.py``: moving
``B`` bytes between two workers costs each of them ``latency_s + B / bandwidth_bps``.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["CLUSTER_BANDWIDTH_BPS", "CLUSTER_LATENCY_S", "LOCAL_BANDWIDTH_BPS", "LOCAL_LATENCY_S", "Link",
           "Resources", "Worker"]

# Between two processes of the development machine (docs/benchmarks.md): large bodies cross in
# shared memory (comm/zmq/shm.py), a 34 MB all-reduce inside a data-parallel step in ~11 ms
# (~3 GB/s of all-reduce, the link figure times the planner's COLLECTIVE_EFFICIENCY); a
# message costs ~100 us.
LOCAL_BANDWIDTH_BPS = 3.5e9
LOCAL_LATENCY_S = 100e-6
# Between pods or machines, unless the resource list says otherwise: a 10 Gb/s network.
CLUSTER_BANDWIDTH_BPS = 1.25e9
CLUSTER_LATENCY_S = 100e-6


class Worker(BaseModel):
    """One worker process and what it may use.

    Attributes:
        name: Unique within the resource list (a pod name, ``local-0``, ...).
        device: ``"cpu"`` or ``"cuda"``.
        cpus: CPU cores it may use (>= 1).
        gpus: GPUs it may use (0 for a CPU worker).
        memory_bytes: The memory budget a plan may fill on it (device memory for a GPU
            worker): parameters, gradients, optimizer state, activations.
        speed: Compute speed relative to the machine that took the profile (2.0 runs the
            profiled forward and backward in half the time).
        host: The machine it runs on, if known: CPU workers of one host share its cores and
            memory bandwidth, which the planner accounts for (None: a machine of its own).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    device: Literal["cpu", "cuda"] = "cpu"
    cpus: int = Field(default=1, ge=1)
    gpus: int = Field(default=0, ge=0)
    memory_bytes: int = Field(gt=0)
    speed: float = Field(default=1.0, gt=0)
    host: str | None = None

    @model_validator(mode="after")
    def _gpus_match_device(self) -> Worker:
        if (self.device == "cuda") != (self.gpus > 0):
            raise ValueError(f"worker {self.name}: device={self.device!r} with gpus={self.gpus}")
        return self


class Link(BaseModel):
    """Bandwidth and latency between two named workers (both directions)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    a: str
    b: str
    bandwidth_bps: float = Field(gt=0)
    latency_s: float = Field(ge=0)


class Resources(BaseModel):
    """Workers and the network between them.

    Attributes:
        workers: At least one worker, names unique.
        bandwidth_bps: Bytes per second between any two workers without a :class:`Link`.
        latency_s: Seconds per message between any two workers without a :class:`Link`.
        links: Exceptions to the defaults for particular pairs.

    Raises:
        pydantic.ValidationError: On duplicate names, links to unknown workers, or bad values.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    workers: tuple[Worker, ...] = Field(min_length=1)
    bandwidth_bps: float = Field(default=LOCAL_BANDWIDTH_BPS, gt=0)
    latency_s: float = Field(default=LOCAL_LATENCY_S, ge=0)
    links: tuple[Link, ...] = ()

    @model_validator(mode="after")
    def _names(self) -> Resources:
        names = [w.name for w in self.workers]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"duplicate worker names: {dupes}")
        unknown = sorted({x for link in self.links for x in (link.a, link.b)} - set(names))
        if unknown:
            raise ValueError(f"links name unknown workers: {unknown}")
        return self

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    def worker(self, name: str) -> Worker:
        """The worker called ``name``.

        Raises:
            KeyError: If there is none.
        """
        for w in self.workers:
            if w.name == name:
                return w
        raise KeyError(f"no worker {name!r}; workers: {[w.name for w in self.workers]}")

    def link(self, a: str, b: str) -> tuple[float, float]:
        """``(bandwidth_bps, latency_s)`` between workers ``a`` and ``b``."""
        for link in self.links:
            if {link.a, link.b} == {a, b}:
                return link.bandwidth_bps, link.latency_s
        return self.bandwidth_bps, self.latency_s

    def slowest_link(self, names: list[str] | tuple[str, ...]) -> tuple[float, float]:
        """The lowest bandwidth and highest latency among all pairs of ``names``."""
        pairs = [self.link(x, y) for i, x in enumerate(names) for y in names[i + 1:]]
        if not pairs:
            return self.bandwidth_bps, self.latency_s
        return min(bw for bw, _ in pairs), max(lat for _, lat in pairs)

    @classmethod
    def local(cls, workers: int = 2, *, memory_bytes: int | None = None,
              memory_fraction: float = 0.8, gpu_memory_bytes: Sequence[int] = ()) -> Resources:
        """This machine as ``workers`` worker processes on loopback, on one host (in order).

        Args:
            workers: How many worker processes (>= 1).
            memory_bytes: Each CPU worker's budget; by default ``memory_fraction`` of the
                machine's physical memory shared equally.
            memory_fraction: The share of physical memory all workers together may fill.
            gpu_memory_bytes: The memory of each GPU to use: worker ``i`` gets GPU ``i`` (one each; it
                runs on ``cuda:i``, coordinator/planning/devices.py) and ``memory_fraction`` of its
                memory as budget. Empty: CPU workers.

        Raises:
            ValueError: If ``workers`` < 1, or GPUs are given but fewer than ``workers``.
        """
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if gpu_memory_bytes and len(gpu_memory_bytes) < workers:
            raise ValueError(f"{workers} local GPU workers need a GPU each, this machine has "
                             f"{len(gpu_memory_bytes)}: run fewer workers or CPU workers")
        if memory_bytes is None:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            memory_bytes = int(total * memory_fraction / workers)
        cpus = max(1, (os.cpu_count() or 1) // workers)
        host = platform.node() or "localhost"
        if gpu_memory_bytes:
            return cls(workers=tuple(
                Worker(name=f"local-{i}", device="cuda", gpus=1, cpus=cpus, host=host,
                       memory_bytes=max(1, int(gpu_memory_bytes[i] * memory_fraction)))
                for i in range(workers)))
        return cls(workers=tuple(Worker(name=f"local-{i}", cpus=cpus, memory_bytes=memory_bytes, host=host)
                                 for i in range(workers)))

    def __str__(self) -> str:
        rows = [f"{len(self.workers)} workers, links {self.bandwidth_bps / 1e9:.2f} GB/s, "
                f"{self.latency_s * 1e6:.0f} us ({len(self.links)} exceptions)"]
        rows += [f"  {w.name}: {w.device} x{max(w.gpus, w.cpus)}, {w.memory_bytes / 2**30:.2f} GiB, "
                 f"speed {w.speed:g}" for w in self.workers]
        return "\n".join(rows)
