"""Where each stage runs: the CPU or a GPU per worker, and which GPU.

[Note: where a stage runs]
The resource list says which workers have GPUs (``Worker.device="cuda"``, ``gpus``);
``runtime.device`` says what to make of it:

- ``cpu``: every stage runs on the CPU;
- ``cuda``: every worker of the plan runs its stage on CUDA. A worker the resource list gives
  no GPU is an error when the plan is made (naming the worker); one whose process has no CUDA
  (its torch sees no device) is an error when the stages are placed, before any step;
- ``auto`` (the default): CUDA on the workers the resource list gives GPUs, where their torch
  has CUDA; the CPU elsewhere (a worker listed with GPUs whose process sees none runs on the
  CPU, with a warning).

The plan records each worker's kind (``StagePlan.devices``, a column of the plan's table);
which GPU is decided when the stages are placed (``coordinator/runtime/devices.py``): a
worker on CUDA runs its stage on ``cuda:LOCAL_RANK``, where LOCAL_RANK is

1. the worker process's ``LOCAL_RANK`` environment variable when it is set (torchrun sets one
   per process it starts, the Kubernetes manifests ``0``: a pod sees only its own GPU) --
   this wins;
2. else the worker's index among the resource list's workers on its host (``Worker.host``; a
   worker without a host is a machine of its own: 0). ``Resources.local`` puts its workers on
   this host in order, so ``local-i`` runs on ``cuda:i``.

Each worker holds one GPU: two workers of one host on one device are refused (NCCL cannot put
two ranks of a group on one GPU, and they would share its memory). The communication
backend of each group follows from the devices its members run on: [Note: a group's backend]
in ``comm/factory.py``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from coordinator.planning.config import Device
from coordinator.planning.plan import Plan
from coordinator.planning.resources import Resources, Worker

__all__ = ["DeviceError", "DeviceKind", "device_kind", "fallback_local_ranks", "with_devices"]

DeviceKind = Literal["cpu", "cuda"]


class DeviceError(ValueError):
    """A stage cannot run where the job asks; the message names the worker and the fix."""


def device_kind(worker: Worker, setting: Device) -> DeviceKind:
    """The kind of device ``worker``'s stage runs on under ``runtime.device=setting`` (see the note).

    Raises:
        DeviceError: ``setting`` is ``cuda`` and the resource list gives the worker no GPU.
    """
    if setting == "cpu":
        return "cpu"
    if worker.device == "cuda":
        return "cuda"
    if setting == "cuda":
        raise DeviceError(f"runtime.device is 'cuda' but worker {worker.name} has no GPU in the resource "
                          f"list (device {worker.device!r}, gpus {worker.gpus}): give it GPUs (device: cuda, "
                          "gpus: 1) or set runtime.device to auto or cpu")
    return "cpu"


def with_devices(plan: Plan, resources: Resources, setting: Device) -> Plan:
    """``plan`` with each stage's ``devices`` (the kind per worker of ``StagePlan.workers``) filled in.

    Raises:
        DeviceError: ``setting`` is ``cuda`` and a worker of the plan has no GPU in the resource list.
        KeyError: The plan names a worker the resource list does not have.
    """
    stages = tuple(st.model_copy(update={"devices": tuple(device_kind(resources.worker(w), setting)
                                                          for w in st.workers)})
                   for st in plan.stages)
    return plan.model_copy(update={"stages": stages})


def fallback_local_ranks(workers: Iterable[Worker]) -> dict[str, int]:
    """Each worker's LOCAL_RANK when its process sets none: its index among the workers of its host
    (rule 2 of the note; a worker without a host is a machine of its own)."""
    seen: dict[str, int] = {}
    out: dict[str, int] = {}
    for w in workers:
        if w.host is None:
            out[w.name] = 0
            continue
        out[w.name] = seen.get(w.host, 0)
        seen[w.host] = out[w.name] + 1
    return out
