"""Devices on the coordinator's side: each placed worker's device and each group's backend, the local
workers' GPUs, and the device the profile runs on.

The rules are [Note: where a stage runs] (``coordinator/planning/devices.py``) and [Note: a group's
backend] (``comm/factory.py``). :func:`place_devices` applies them when a runtime places its stages:
the plan gives each worker's kind of device, the worker's card what its process has (the CUDA devices
its torch sees, its ``LOCAL_RANK``), so a stage asked onto a GPU its worker does not have is refused
there, naming the worker, before any step runs.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from comm.factory import resolve_backend
from coordinator.planning.config import Device, RuntimeConfig
from coordinator.planning.devices import DeviceError, device_kind, fallback_local_ranks
from coordinator.planning.plan import Plan
from coordinator.planning.resources import Resources
from services.protocol import WorkerCard

__all__ = ["DeviceRequest", "Placement", "local_resources", "place_devices", "profile_device"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeviceRequest:
    """What a job asks of devices (its ``runtime`` section) and what the resource list says of hosts.

    Attributes:
        setting: ``runtime.device``.
        pipeline_backend: ``runtime.pipeline_backend`` (default ``runtime.comm_backend``).
        data_parallel_backend: ``runtime.data_parallel_backend`` (default ``runtime.comm_backend``).
        local_ranks: Each worker's LOCAL_RANK when its process sets none (its index on its host).
        hosts: Each worker's host, if the resource list knows it (two workers of one host may not
            share a GPU).
    """

    setting: Device = "auto"
    pipeline_backend: str = "auto"
    data_parallel_backend: str = "auto"
    local_ranks: Mapping[str, int] = field(default_factory=dict)
    hosts: Mapping[str, str | None] = field(default_factory=dict)

    @classmethod
    def of(cls, runtime: RuntimeConfig, resources: Resources) -> DeviceRequest:
        """The request of a job's ``runtime`` section on ``resources``."""
        return cls(setting=runtime.device, pipeline_backend=runtime.pipeline_backend or runtime.comm_backend,
                   data_parallel_backend=runtime.data_parallel_backend or runtime.comm_backend,
                   local_ranks=fallback_local_ranks(resources.workers),
                   hosts={w.name: w.host for w in resources.workers})


@dataclass(frozen=True)
class Placement:
    """Where a plan's stages run and how its groups talk.

    Attributes:
        devices: Each placed worker's device, ``"cpu"`` or ``"cuda:N"``.
        pipeline: The backend of replica ``r``'s pipeline, per replica.
        data_parallel: The backend of stage ``s``'s data-parallel group, per stage.
    """

    devices: dict[str, str]
    pipeline: tuple[str, ...]
    data_parallel: tuple[str, ...]

    def __str__(self) -> str:
        devices = ", ".join(f"{w} {d}" for w, d in sorted(self.devices.items()))
        pipes = ", ".join(f"r{r} {b}" for r, b in enumerate(self.pipeline))
        groups = ", ".join(f"s{s} {b}" for s, b in enumerate(self.data_parallel))
        return f"devices {devices}; pipelines {pipes}; data-parallel groups {groups}"


def place_devices(plan: Plan, request: DeviceRequest, cards: Mapping[str, WorkerCard]) -> Placement:
    """Each placed worker's device and each group's backend (see the module docstring).

    Args:
        plan: The plan; ``StagePlan.devices`` gives each worker's kind (none: the CPU).
        request: The job's settings and the resource list's hosts.
        cards: The placed workers' cards, by name.

    Raises:
        DeviceError: Naming the worker: ``runtime.device`` is ``cuda`` and its process has no CUDA; its
            LOCAL_RANK is not a device its process sees; two workers of one host on one GPU; ``nccl``
            asked for a group with a member on the CPU.
    """
    devices: dict[str, str] = {}
    for st in plan.stages:
        kinds = st.devices or ("cpu",) * len(st.workers)
        for worker, kind in zip(st.workers, kinds, strict=True):
            devices[worker] = "cpu" if kind == "cpu" else _cuda_device(worker, request, cards.get(worker))
    _check_shared_gpus(devices, request.hosts)
    pipeline = tuple(_backend(request.pipeline_backend, {w: devices[w] for w in row},
                              f"the pipeline of replica {r}", "runtime.pipeline_backend")
                     for r, row in enumerate(plan.placement))
    groups = tuple(_backend(request.data_parallel_backend, {w: devices[w] for w in group},
                            f"the data-parallel group of stage {s}", "runtime.data_parallel_backend")
                   for s, group in enumerate(plan.dp_groups))
    return Placement(devices=devices, pipeline=pipeline, data_parallel=groups)


def _cuda_device(worker: str, request: DeviceRequest, card: WorkerCard | None) -> str:
    """``cuda:LOCAL_RANK`` for ``worker``, or the CPU when ``auto`` finds no CUDA in its process."""
    if card is None or card.gpus == 0:
        if request.setting == "cuda":
            raise DeviceError(f"worker {worker}: runtime.device is 'cuda' but its process sees no CUDA "
                              "device (torch.cuda.is_available() is False there: a CPU build of torch, no "
                              "driver, or no GPU given to it): run it where CUDA is, or set runtime.device "
                              "to auto or cpu")
        log.warning("worker %s: the resource list gives it GPUs but its process sees no CUDA device: its "
                    "stage runs on the CPU (runtime.device: cuda makes this an error)", worker)
        return "cpu"
    if card.local_rank is not None:
        rank, source = card.local_rank, "its LOCAL_RANK"
    else:
        rank = request.local_ranks.get(worker, 0)
        host = request.hosts.get(worker)
        source = (f"its index among the resource list's workers on host {host}" if host is not None
                  else "a worker alone on its host")
    if rank >= card.gpus:
        raise DeviceError(f"worker {worker}: LOCAL_RANK {rank} ({source}), but its process sees "
                          f"{card.gpus} CUDA device(s): set its LOCAL_RANK below {card.gpus}, or put fewer "
                          "GPU workers on its host")
    return f"cuda:{rank}"


def _check_shared_gpus(devices: Mapping[str, str], hosts: Mapping[str, str | None]) -> None:
    """Raise DeviceError if two workers of one (known) host run on one GPU."""
    seen: dict[tuple[str, str], str] = {}
    for worker, device in sorted(devices.items()):
        host = hosts.get(worker)
        if device == "cpu" or host is None:
            continue
        other = seen.setdefault((host, device), worker)
        if other != worker:
            raise DeviceError(f"workers {other} and {worker} would both run on {device} of host {host}: "
                              "give each worker process of a host its own LOCAL_RANK (torchrun does), or "
                              "list them in the resource list in the order of their GPUs")


def _backend(requested: str, members: Mapping[str, str], what: str, key: str) -> str:
    """The backend of the group ``members`` (worker -> device) form; one member forms no group."""
    if len(members) == 1:
        return resolve_backend("auto", list(members.values()))
    try:
        return resolve_backend(requested, list(members.values()))
    except ValueError:
        cpu = [w for w, d in members.items() if d == "cpu"]
        raise DeviceError(f"{key} is 'nccl' but {what} has worker(s) {', '.join(cpu)} on the CPU, and NCCL "
                          f"moves CUDA tensors only: set {key} to auto (zmq for a group with a CPU member) "
                          "or zmq or gloo, or run them on GPUs") from None


def local_resources(runtime: RuntimeConfig) -> Resources:
    """This machine as ``runtime.workers`` local workers: one GPU each when ``runtime.device`` asks for CUDA
    (``cuda``) or allows it (``auto``) and there are enough, else CPU workers.

    Raises:
        DeviceError: ``runtime.device`` is ``cuda`` and this machine has fewer GPUs than workers.
    """
    n = runtime.workers
    if runtime.device == "cpu":
        return Resources.local(n)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus >= n:
        return Resources.local(n, gpu_memory_bytes=[torch.cuda.get_device_properties(i).total_memory
                                                    for i in range(n)])
    if runtime.device == "cuda" and not gpus:
        raise DeviceError("runtime.device is 'cuda' but this machine's torch sees no CUDA device: install a "
                          "CUDA build of torch, or set runtime.device to auto or cpu")
    if runtime.device == "cuda":
        raise DeviceError(f"runtime.device is 'cuda': the {n} local workers need a GPU each, and this "
                          f"machine's torch sees {gpus}: lower runtime.workers to {gpus} or set "
                          "runtime.device to auto or cpu")
    if gpus:
        log.info("%d GPU(s) for %d local workers: they run on the CPU (runtime.workers: %d would use the "
                 "GPUs)", gpus, n, gpus)
    return Resources.local(n)


def profile_device(resources: Resources, setting: Device) -> torch.device:
    """Where to profile the model so that the plan's predictions hold: CUDA when the workers run on CUDA and
    this process has it (a warning says when it does not, or when the workers mix CPUs and GPUs).

    Raises:
        DeviceError: ``setting`` is ``cuda`` and a worker has no GPU in the resource list.
    """
    kinds = {device_kind(w, setting) for w in resources.workers}
    if "cuda" not in kinds:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        log.warning("the workers run on CUDA but this coordinator has no CUDA: the profile is the CPU's, so "
                    "the plan's predicted times are off (the plan itself may still be a good one)")
        return torch.device("cpu")
    if "cpu" in kinds:
        log.warning("some workers run on CUDA, some on the CPU: the profile is CUDA's, so the CPU workers' "
                    "predicted times are off (give them a lower speed in the resource list)")
    return torch.device("cuda", torch.cuda.current_device())
