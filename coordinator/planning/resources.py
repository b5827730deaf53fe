"""The resource list: workers (CPU/GPU, memory, speed) and the links between them.

A :class:`Resources` is what a user hands the coordinator besides the model and the data.
It is a pydantic model (``extra="forbid"``) so it loads from JSON or a ConfigMap and is
checked on construction. :meth:`Resources.local` describes this machine split into ``N``
worker processes.

Bandwidth and latency follow [Note: transfer cost] in ``coordinator/planning/cutting.py``: moving
``B`` bytes between two workers costs each of them ``latency_s + B / bandwidth_bps``.

[Note: which link joins two workers]
A cluster's links differ inside a host and between hosts, with a few exceptions. The link of
two workers is the first that applies of:

1. a :class:`Link` naming the two workers (``links``, the first one listed wins);
2. both on one host (``Worker.host``, not None): ``intra_host`` if given;
3. on two hosts with a :class:`HostLink` naming them (``host_links``, the first one wins);
4. the defaults ``bandwidth_bps`` and ``latency_s`` (between hosts, or anywhere when the list gives
   no more).

A resource list without ``intra_host`` and ``host_links`` has today's flat links (the defaults and
the per-pair exceptions); ``coordinator/planning/resource_file.py`` writes a cluster compactly as
hosts of several workers and expands it to this.

[Note: the slowest link without visiting every pair]
:meth:`Resources.slowest_link` answers for a group of workers (a placement of 1,024, a stage's
replicas) what the pairwise minimum over :meth:`Resources.link` would, in O(n + exceptions):
the pairs fall into classes, one per host holding two or more of the names (its intra-host
link), one per pair of hosts named by a ``HostLink``, and the rest (the defaults), whose pair
counts follow from the number of names per host. A class's link counts when it has a pair that
no per-worker ``Link`` overrides (the overriding links are counted per class); each
overriding link present counts itself. The lookups are indexed once per (frozen) list.
"""

from __future__ import annotations

import functools
import os
import platform
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:
    from coordinator.planning.worker_table import WorkerTable

__all__ = ["CLUSTER_BANDWIDTH_BPS", "CLUSTER_LATENCY_S", "LOCAL_BANDWIDTH_BPS", "LOCAL_LATENCY_S", "HostLink",
           "Link", "LinkSpeed", "Resources", "Worker"]

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
        host_cpus: The cores of its host, shared by every worker on it (None: its host's workers'
            ``cpus`` together, so none waits for a core). Each worker runs ``cpus`` threads; more
            threads busy at once than the host has cores slow them all ([Note: shared cores] in
            ``coordinator/planning/simulator.py``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    device: Literal["cpu", "cuda"] = "cpu"
    cpus: int = Field(default=1, ge=1)
    gpus: int = Field(default=0, ge=0)
    memory_bytes: int = Field(gt=0)
    speed: float = Field(default=1.0, gt=0)
    host: str | None = None
    host_cpus: int | None = Field(default=None, ge=1)

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


class LinkSpeed(BaseModel):
    """Bandwidth and latency of a kind of link (inside a host, between hosts)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    bandwidth_bps: float = Field(gt=0)
    latency_s: float = Field(ge=0)


class HostLink(BaseModel):
    """Bandwidth and latency between any worker of host ``a`` and any of host ``b`` (both directions)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    a: str
    b: str
    bandwidth_bps: float = Field(gt=0)
    latency_s: float = Field(ge=0)


Speed = tuple[float, float]  # (bandwidth_bps, latency_s)
HostKey = tuple[str, str]  # ("host", name) or, for a worker without a host, ("alone", worker name)


@dataclass(frozen=True)
class _Index:
    """A resource list's lookups, built once (see [Note: the slowest link without visiting every pair])."""

    by_name: dict[str, Worker]
    host_of: dict[str, HostKey]
    pairs: dict[frozenset[str], Speed]  # per-worker links, the first listed per pair
    host_pairs: dict[frozenset[HostKey], Speed]  # per-host-pair links, the first listed per pair
    # per worker, its host as a number: >= 0 for a host, a negative one of its own for a worker without
    host_id: dict[str, int]


def _host_key(w: Worker) -> HostKey:
    return ("host", w.host) if w.host is not None else ("alone", w.name)


class Resources(BaseModel):
    """Workers and the network between them.

    Attributes:
        workers: At least one worker, names unique.
        bandwidth_bps: Bytes per second between any two workers without a :class:`Link`.
        latency_s: Seconds per message between any two workers without a :class:`Link`.
        links: Exceptions to the defaults for particular pairs of workers.
        intra_host: Between two workers of one host (``Worker.host``); None: the defaults.
        host_links: Exceptions to the defaults for particular pairs of hosts.

    See [Note: which link joins two workers].

    Raises:
        pydantic.ValidationError: On duplicate names, links to unknown workers or hosts, or bad values.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    workers: tuple[Worker, ...] = Field(min_length=1)
    bandwidth_bps: float = Field(default=LOCAL_BANDWIDTH_BPS, gt=0)
    latency_s: float = Field(default=LOCAL_LATENCY_S, ge=0)
    links: tuple[Link, ...] = ()
    intra_host: LinkSpeed | None = None
    host_links: tuple[HostLink, ...] = ()

    @model_validator(mode="after")
    def _names(self) -> Resources:
        counts = Counter(w.name for w in self.workers)
        seen = set(counts)
        dupes = sorted(n for n, k in counts.items() if k > 1)
        if dupes:
            raise ValueError(f"duplicate worker names: {dupes}")
        unknown = sorted({x for link in self.links for x in (link.a, link.b)} - seen)
        if unknown:
            raise ValueError(f"links name unknown workers: {unknown}")
        hosts = {w.host for w in self.workers if w.host is not None}
        unknown = sorted({x for link in self.host_links for x in (link.a, link.b)} - hosts)
        if unknown:
            raise ValueError(f"host_links name unknown hosts: {unknown} (hosts: {sorted(hosts)[:8]})")
        return self

    @functools.cached_property
    def _index(self) -> _Index:
        pairs: dict[frozenset[str], Speed] = {}
        for link in self.links:
            pairs.setdefault(frozenset((link.a, link.b)), (link.bandwidth_bps, link.latency_s))
        host_pairs: dict[frozenset[HostKey], Speed] = {}
        for hl in self.host_links:
            ends = frozenset((("host", hl.a), ("host", hl.b)))
            host_pairs.setdefault(ends, (hl.bandwidth_bps, hl.latency_s))
        numbers: dict[HostKey, int] = {}
        host_id = {w.name: numbers.setdefault(key, len(numbers)) if key[0] == "host" else -1 - i
                   for i, w in enumerate(self.workers) for key in (_host_key(w),)}
        return _Index({w.name: w for w in self.workers}, {w.name: _host_key(w) for w in self.workers},
                      pairs, host_pairs, host_id)

    @property
    def links_follow_hosts(self) -> bool:
        """Whether every link is the one inside a host or the default (no :class:`Link` or :class:`HostLink`
        names a pair): a group's slowest link then depends only on whether two of it share a host and
        whether two do not (:meth:`slowest_by_kind`)."""
        index = self._index
        return not index.pairs and not index.host_pairs

    def slowest_by_kind(self, inside: bool, between: bool) -> Speed:
        """The slowest of the link inside a host (where ``inside``) and between two (where ``between``), on a
        list whose :attr:`links_follow_hosts`; the defaults for neither."""
        return self._kinds[inside, between]

    @functools.cached_property
    def _kinds(self) -> dict[tuple[bool, bool], Speed]:
        return {(inside, between): self._by_kind(inside, between) for inside in (False, True)
                for between in (False, True)}

    def _by_kind(self, inside: bool, between: bool) -> Speed:
        """The slowest of the link inside a host (where ``inside``) and between two (where ``between``):
        the answer of a list whose links depend on that alone (no per-worker or per-host-pair link)."""
        speeds = ([(self.intra_host.bandwidth_bps, self.intra_host.latency_s) if self.intra_host is not None
                   else self.default_link] if inside else []) + ([self.default_link] if between else [])
        if not speeds:
            return self.default_link
        return min(bw for bw, _ in speeds), max(lat for _, lat in speeds)

    def host_number(self, name: str) -> int:
        """Worker ``name``'s host as a number: hosts numbered from 0 in the order of their first worker, a
        worker without a host a negative number of its own."""
        return self._index.host_id[name]

    @functools.cached_property
    def worker_table(self) -> WorkerTable:
        """Every worker's planning fields as arrays (built once per list)."""
        from coordinator.planning.worker_table import WorkerTable

        return WorkerTable.of(self)

    def host_cores(self, name: str) -> int:
        """The cores of worker ``name``'s host: its workers' ``host_cpus`` (the most given), else their
        ``cpus`` together (a worker without a host: its own ``cpus``)."""
        return self._cores[self.host_of(name)]

    @functools.cached_property
    def _cores(self) -> dict[HostKey, int]:
        given: dict[HostKey, int] = {}
        summed: Counter[HostKey] = Counter()
        for w in self.workers:
            key = _host_key(w)
            summed[key] += w.cpus
            if w.host_cpus is not None:
                given[key] = max(given.get(key, 0), w.host_cpus)
        return {key: given.get(key, total) for key, total in summed.items()}

    @functools.cached_property
    def host_groups(self) -> tuple[tuple[str, ...], ...]:
        """The workers' names by host, hosts in the order of their first worker, workers in list order
        (a worker without a host is a group of its own)."""
        groups: dict[HostKey, list[str]] = {}
        for w in self.workers:
            groups.setdefault(_host_key(w), []).append(w.name)
        return tuple(tuple(names) for names in groups.values())

    def crowded_hosts(self) -> list[tuple[str, int, int, int]]:
        """The hosts whose CPU workers want more threads together than the host has cores (their ``cpus``
        against its ``host_cpus``), as ``(host, workers, threads, cores)``, in host order. Their workers take
        turns on the cores while they compute, and the planner prices them so ([Note: shared cores] in
        ``coordinator/planning/simulator.py``)."""
        crowded = []
        for names in self.host_groups:
            workers = [self.worker(name) for name in names]
            host = workers[0].host
            cpu = [w for w in workers if w.device == "cpu"]
            if host is None or not cpu:
                continue
            threads, cores = sum(w.cpus for w in cpu), self.host_cores(names[0])
            if threads > cores:
                crowded.append((host, len(cpu), threads, cores))
        return crowded

    @functools.cached_property
    def names_by_host(self) -> tuple[str, ...]:
        """Every worker's name, host by host: :attr:`host_groups` one after the other."""
        return tuple(name for names in self.host_groups for name in names)

    @functools.cached_property
    def host_cores_given(self) -> bool:
        """Whether some CPU worker has a host whose cores are given (``Worker.host_cpus``)."""
        return any(w.device == "cpu" and w.host is not None and w.host_cpus is not None for w in self.workers)

    @property
    def host_dependent_links(self) -> bool:
        """Whether a link depends on the hosts of its workers (``intra_host`` or ``host_links`` given)."""
        return self.intra_host is not None or bool(self.host_links)

    def host_of(self, name: str) -> HostKey:
        """The host of worker ``name`` as a key: ``("host", h)``, or ``("alone", name)`` without one."""
        return self._index.host_of[name]

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    def worker(self, name: str) -> Worker:
        """The worker called ``name``.

        Raises:
            KeyError: If there is none.
        """
        found = self._index.by_name.get(name)
        if found is None:
            names = [w.name for w in self.workers]
            raise KeyError(f"no worker {name!r}; workers: {names[:16]}{' ...' if len(names) > 16 else ''}")
        return found

    @property
    def default_link(self) -> Speed:
        """``(bandwidth_bps, latency_s)`` between workers nothing more specific joins."""
        return self.bandwidth_bps, self.latency_s

    @functools.cached_property
    def fastest_link(self) -> Speed:
        """The highest bandwidth and the lowest latency of any link the list can give two workers (each
        from its own link, so faster than or as fast as every link: what a bound on transfers may assume)."""
        speeds = [self.default_link, *((lk.bandwidth_bps, lk.latency_s) for lk in self.links),
                  *((hl.bandwidth_bps, hl.latency_s) for hl in self.host_links)]
        if self.intra_host is not None:
            speeds.append((self.intra_host.bandwidth_bps, self.intra_host.latency_s))
        return max(bw for bw, _ in speeds), min(lat for _, lat in speeds)

    @functools.cached_property
    def fastest_link_between_hosts(self) -> Speed:
        """:attr:`fastest_link` without the link inside a host: the fastest any two workers of different
        hosts can have (a group of more workers than one host holds has such a pair)."""
        speeds = [self.default_link, *((lk.bandwidth_bps, lk.latency_s) for lk in self.links),
                  *((hl.bandwidth_bps, hl.latency_s) for hl in self.host_links)]
        return max(bw for bw, _ in speeds), min(lat for _, lat in speeds)

    @property
    def most_on_a_host(self) -> int:
        """The most workers one host holds (a worker without a host is a host of its own)."""
        return max(len(group) for group in self.host_groups)

    def _class_link(self, ha: HostKey, hb: HostKey) -> Speed:
        """The link of two workers on hosts ``ha`` and ``hb`` that no per-worker link names."""
        if ha == hb and ha[0] == "host":
            return ((self.intra_host.bandwidth_bps, self.intra_host.latency_s) if self.intra_host is not None
                    else self.default_link)
        return self._index.host_pairs.get(frozenset((ha, hb)), self.default_link)

    def link(self, a: str, b: str) -> Speed:
        """``(bandwidth_bps, latency_s)`` between workers ``a`` and ``b`` (see [Note: which link joins
        two workers])."""
        index = self._index
        found = index.pairs.get(frozenset((a, b)))
        if found is not None:
            return found
        if a in index.host_of and b in index.host_of:
            return self._class_link(index.host_of[a], index.host_of[b])
        return self.default_link

    def slowest_of_pairs(self, pairs: Iterable[tuple[str, str]]) -> Speed:
        """The lowest bandwidth and highest latency among the links of ``pairs`` (the defaults for none),
        each pair of hosts looked up once."""
        index = self._index
        if not index.pairs and not index.host_pairs:  # a link is a host's own or the default: which ones
            pairs = list(pairs)
            ids = index.host_id
            try:
                kinds = {(h := ids[a]) == ids[b] and h >= 0 for a, b in pairs}
            except KeyError:  # a name not in the list: the general path below, with the pairs seen
                pass
            else:
                return self._by_kind(True in kinds, False in kinds)
        classes: set[tuple[HostKey, HostKey]] = set()
        speeds: list[Speed] = []
        for a, b in pairs:
            own = index.pairs.get(frozenset((a, b))) if index.pairs else None
            if own is not None:
                speeds.append(own)
                continue
            classes.add((index.host_of.get(a, ("alone", a)), index.host_of.get(b, ("alone", b))))
        speeds += [self._class_link(ha, hb) for ha, hb in classes]
        if not speeds:
            return self.default_link
        return min(bw for bw, _ in speeds), max(lat for _, lat in speeds)

    def slowest_link(self, names: Sequence[str]) -> Speed:
        """The lowest bandwidth and highest latency among all pairs of ``names`` (the defaults for
        fewer than two), in O(len(names) + exceptions): see [Note: the slowest link without
        visiting every pair]. A name given twice counts its pair with itself."""
        if len(names) < 2:
            return self.default_link
        index = self._index
        unique = set(names)
        if (not index.pairs and not index.host_pairs and len(unique) == len(names)
                and unique <= index.host_id.keys()):
            numbers = {index.host_id[n] for n in names}  # workers without a host have a number each
            return self._by_kind(len(numbers) < len(names), len(numbers) > 1)
        host_of = {n: index.host_of.get(n, ("alone", n)) for n in unique}  # unknown names: as link() does
        speeds: list[Speed] = []
        if len(unique) < len(names):  # today's pairwise answer pairs a repeated name with itself
            repeated = [n for n, k in Counter(names).items() if k > 1]
            speeds += [self.link(n, n) for n in repeated]
        per_host = Counter(host_of.values())
        # pairs per class: a host's own pairs, a named host pair's, and the rest (the defaults)
        pairs: dict[frozenset[HostKey], int] = {}
        for host, k in per_host.items():
            if k > 1:
                pairs[frozenset((host,))] = k * (k - 1) // 2
        cross = len(unique) * (len(unique) - 1) // 2 - sum(pairs.values())
        for key in index.host_pairs:
            ends = tuple(key)
            if len(ends) == 2 and ends[0] in per_host and ends[1] in per_host:
                pairs[key] = per_host[ends[0]] * per_host[ends[1]]
                cross -= pairs[key]
        overridden: Counter[frozenset[HostKey]] = Counter()
        defaults_overridden = 0
        for named, speed in index.pairs.items():
            a, b = (*named, *named)[:2]  # a link of a worker with itself pairs no two of them
            if a == b or a not in unique or b not in unique:
                continue
            speeds.append(speed)
            hosts = frozenset((host_of[a], host_of[b]))
            if hosts in pairs:  # it overrides one pair of a host's own or of a named host pair
                overridden[hosts] += 1
            else:
                defaults_overridden += 1
        for key, count in pairs.items():
            if count > overridden[key]:
                ends = tuple(key)
                speeds.append(self._class_link(ends[0], ends[-1]))
        if cross > defaults_overridden:
            speeds.append(self.default_link)
        return min(bw for bw, _ in speeds), max(lat for _, lat in speeds)

    @classmethod
    def local(cls, workers: int = 2, *, memory_bytes: int | None = None,
              memory_fraction: float = 0.8, gpu_memory_bytes: Sequence[int] = ()) -> Resources:
        """This machine as ``workers`` worker processes on loopback, on one host (in order) of
        ``os.cpu_count()`` cores: more workers than cores share them.

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
        cores = os.cpu_count() or 1
        cpus = max(1, cores // workers)
        host = platform.node() or "localhost"
        if gpu_memory_bytes:
            return cls(workers=tuple(
                Worker(name=f"local-{i}", device="cuda", gpus=1, cpus=cpus, host=host,
                       memory_bytes=max(1, int(gpu_memory_bytes[i] * memory_fraction)))
                for i in range(workers)))
        return cls(workers=tuple(Worker(name=f"local-{i}", cpus=cpus, memory_bytes=memory_bytes, host=host,
                                        host_cpus=cores) for i in range(workers)))

    def summary(self) -> str:
        """One line: how many workers on how many hosts, and the links."""
        sizes = Counter(len(g) for g in self.host_groups)
        per = ", ".join(f"{n} of {k}" for k, n in sorted(sizes.items(), reverse=True))
        kinds = Counter(w.device for w in self.workers)
        devices = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))

        def speed(bw: float, lat: float) -> str:
            return f"{bw / 1e9:.3g} GB/s, {lat * 1e6:.3g} us"

        inside = (f"{speed(self.intra_host.bandwidth_bps, self.intra_host.latency_s)} inside a host, "
                  if self.intra_host is not None else "")
        exceptions = len(self.links) + len(self.host_links)
        return (f"{self.num_workers} workers ({devices}) on {len(self.host_groups)} host(s) ({per}); links "
                f"{inside}{speed(*self.default_link)}{' between hosts' if inside else ''}"
                + (f", {exceptions} exception(s)" if exceptions else ""))

    def __str__(self) -> str:
        inside = self.intra_host
        rows = [f"{len(self.workers)} workers, links {self.bandwidth_bps / 1e9:.2f} GB/s, "
                f"{self.latency_s * 1e6:.0f} us"
                + (f" ({inside.bandwidth_bps / 1e9:.2f} GB/s, {inside.latency_s * 1e6:.0f} us inside a host)"
                   if inside is not None else "")
                + f" ({len(self.links) + len(self.host_links)} exceptions)"]
        rows += [f"  {w.name}: {w.device} x{max(w.gpus, w.cpus)}, {w.memory_bytes / 2**30:.2f} GiB, "
                 f"speed {w.speed:g}" for w in self.workers]
        return "\n".join(rows)
