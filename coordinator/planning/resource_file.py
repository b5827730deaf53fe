"""A resource file: a cluster written as hosts of several workers, expanded to a :class:`Resources`.

``cellmesh plan JOB --resources FILE`` plans for the workers a file lists instead of this
machine's. A file (YAML or JSON) is either a :class:`Resources` as it is (``workers:`` one by
one) or, compactly, a :class:`ClusterFile`::

    hosts:
      - {name: gpu, count: 128, workers: 8, device: cuda, gpus: 1, memory: 80GiB}
    intra_host: {bandwidth_bps: 300e9, latency_s: 5e-6}    # NVLink inside a host
    inter_host: {bandwidth_bps: 50e9, latency_s: 20e-6}    # the network between hosts
    host_links: [{a: gpu-0, b: gpu-1, bandwidth_bps: 100e9, latency_s: 10e-6}]
    links: [{a: gpu-0-0, b: gpu-0-1, bandwidth_bps: 10e9, latency_s: 1e-5}]

A host entry with ``count: N`` is N hosts ``{name}-0`` .. ``{name}-{N-1}`` (``count: 1``: the
host ``{name}``); each host's ``workers`` are ``{host}-0`` .. in order, each with the entry's
``device``, ``cpus``, ``gpus``, ``memory`` (bytes, or ``"80GiB"``, ``"512MB"``) and ``speed``;
``cores`` is each host's cores (its CPU workers share them: more threads than cores take turns, and the
plans are priced so), by default its workers' ``cpus`` together.
``intra_host`` joins two workers of one host, ``inter_host`` any two others; ``host_links``
and ``links`` are the exceptions for pairs of hosts and of workers (see [Note: which link
joins two workers] in ``coordinator/planning/resources.py``). Without them the links are this
machine's shared memory inside a host and a 10 Gb/s network between hosts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ByteSize, ConfigDict, Field, ValidationError

from coordinator.planning.resources import (
    CLUSTER_BANDWIDTH_BPS,
    CLUSTER_LATENCY_S,
    LOCAL_BANDWIDTH_BPS,
    LOCAL_LATENCY_S,
    HostLink,
    Link,
    LinkSpeed,
    Resources,
    Worker,
)

__all__ = ["ClusterFile", "HostGroup", "ResourceFileError", "load_resources", "parse_resources"]


class ResourceFileError(ValueError):
    """A resource file cannot be read: the message names the file, what is wrong and the fix."""


class HostGroup(BaseModel):
    """``count`` hosts of ``workers`` workers each, all alike (one entry of ``hosts:``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    count: int = Field(default=1, ge=1)
    workers: int = Field(ge=1)
    device: Literal["cpu", "cuda"] = "cpu"
    cpus: int = Field(default=1, ge=1)
    gpus: int = Field(default=0, ge=0)
    memory: ByteSize
    cores: int | None = Field(default=None, ge=1)  # each host's cores (None: its workers' cpus together)
    speed: float = Field(default=1.0, gt=0)

    def host_names(self) -> list[str]:
        return [self.name] if self.count == 1 else [f"{self.name}-{i}" for i in range(self.count)]


class ClusterFile(BaseModel):
    """The compact form of a resource file (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    hosts: tuple[HostGroup, ...] = Field(min_length=1)
    intra_host: LinkSpeed = LinkSpeed(bandwidth_bps=LOCAL_BANDWIDTH_BPS, latency_s=LOCAL_LATENCY_S)
    inter_host: LinkSpeed = LinkSpeed(bandwidth_bps=CLUSTER_BANDWIDTH_BPS, latency_s=CLUSTER_LATENCY_S)
    host_links: tuple[HostLink, ...] = ()
    links: tuple[Link, ...] = ()

    def resources(self) -> Resources:
        """The resource list: every host's workers in the order written.

        Raises:
            pydantic.ValidationError: Two hosts or workers share a name, or a link names an unknown one.
        """
        workers = tuple(
            Worker(name=f"{host}-{i}", device=group.device, cpus=group.cpus, gpus=group.gpus,
                   memory_bytes=int(group.memory), speed=group.speed, host=host, host_cpus=group.cores)
            for group in self.hosts for host in group.host_names() for i in range(group.workers))
        return Resources(workers=workers, bandwidth_bps=self.inter_host.bandwidth_bps,
                         latency_s=self.inter_host.latency_s, links=self.links, intra_host=self.intra_host,
                         host_links=self.host_links)


def parse_resources(data: Any, where: str = "the resource list") -> Resources:
    """``data`` (a mapping read from a file) as a resource list: compact (``hosts:``) or whole (``workers:``).

    Raises:
        ResourceFileError: It is neither, or invalid (the message lists each bad field).
    """
    if not isinstance(data, dict) or not ({"hosts", "workers"} & data.keys()):
        raise ResourceFileError(f"{where}: expected a mapping with 'hosts:' (hosts of several workers) or "
                                "'workers:' (one by one); see docs/running.md, 'Resource files'")
    if "hosts" in data and "workers" in data:
        raise ResourceFileError(f"{where}: give 'hosts:' or 'workers:', not both")
    try:
        if "hosts" in data:
            return ClusterFile.model_validate(data).resources()
        return Resources.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'the file'}: {e['msg']}"
                             for e in exc.errors())
        raise ResourceFileError(f"{where} is invalid: {problems}") from None


def load_resources(path: str | Path) -> Resources:
    """The resource list a YAML or JSON file describes (see the module docstring).

    Raises:
        ResourceFileError: The file is missing, not YAML/JSON, or not a valid resource list.
    """
    file = Path(path)
    where = f"resource file {file}"
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise ResourceFileError(f"{where} cannot be read: {exc.strerror or exc}; give an existing "
                                "YAML or JSON file") from None
    try:
        data = json.loads(text) if file.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise ResourceFileError(f"{where} is not valid {'JSON' if file.suffix == '.json' else 'YAML'}: "
                                f"{' '.join(str(exc).split())}") from None
    return parse_resources(data, where)
