"""Where stages run: the kind of device per worker and setting, the fallback LOCAL_RANK, the plan's table."""

from __future__ import annotations

import re

import pytest

from coordinator.planning.config import Device, PlanConfig
from coordinator.planning.devices import DeviceError, device_kind, fallback_local_ranks, with_devices
from coordinator.planning.plan import Plan
from coordinator.planning.planner import choose_plan
from coordinator.planning.profile import Profile
from coordinator.planning.resources import Resources, Worker

MiB = 2**20
CPU = Worker(name="c", memory_bytes=MiB)
GPU = Worker(name="g", device="cuda", gpus=1, memory_bytes=MiB)


@pytest.mark.parametrize(("worker", "setting", "kind"), [
    (GPU, "auto", "cuda"), (CPU, "auto", "cpu"),  # auto: where the resource list gives GPUs
    (GPU, "cpu", "cpu"), (CPU, "cpu", "cpu"),  # cpu: everywhere
    (GPU, "cuda", "cuda"),
])
def test_the_kind_of_device_follows_the_resource_list_and_the_setting(worker: Worker, setting: Device,
                                                                      kind: str) -> None:
    assert device_kind(worker, setting) == kind


def test_cuda_on_a_worker_without_gpus_is_refused_naming_it() -> None:
    with pytest.raises(DeviceError, match=r"runtime.device is 'cuda' but worker c has no GPU in the resource "
                                          r"list \(device 'cpu', gpus 0\): give it GPUs"):
        device_kind(CPU, "cuda")


def test_the_fallback_local_rank_is_the_index_among_the_workers_of_a_host() -> None:
    workers = [Worker(name="a0", memory_bytes=1, host="a"), Worker(name="b0", memory_bytes=1, host="b"),
               Worker(name="a1", memory_bytes=1, host="a"), Worker(name="solo", memory_bytes=1),
               Worker(name="a2", memory_bytes=1, host="a"), Worker(name="solo2", memory_bytes=1)]
    assert fallback_local_ranks(workers) == {"a0": 0, "b0": 0, "a1": 1, "solo": 0, "a2": 2, "solo2": 0}
    local = Resources.local(3, gpu_memory_bytes=[8 << 30] * 4)  # one host, in order: local-i on cuda:i
    assert fallback_local_ranks(local.workers) == {"local-0": 0, "local-1": 1, "local-2": 2}


def test_local_gpu_workers_get_one_gpu_each() -> None:
    local = Resources.local(2, gpu_memory_bytes=[10 << 30, 20 << 30], memory_fraction=0.5)
    assert [(w.device, w.gpus, w.memory_bytes) for w in local.workers] == [("cuda", 1, 5 << 30),
                                                                          ("cuda", 1, 10 << 30)]
    assert all(w.device == "cpu" and w.gpus == 0 for w in Resources.local(2).workers)
    with pytest.raises(ValueError, match="3 local GPU workers need a GPU each, this machine has 2"):
        Resources.local(3, gpu_memory_bytes=[1 << 30] * 2)


def _plan(resources: Resources) -> Plan:
    profile = Profile.synthetic([1e-3] * 4, param_bytes=[MiB] * 4, activation_bytes=[MiB] * 4,
                                cut_bytes=[1024] * 3, microbatch_size=4)
    return choose_plan(profile, resources, PlanConfig(data_parallel=2, num_stages=2), global_batch=16)


def test_the_plan_records_each_workers_device_and_prints_it_per_stage() -> None:
    mixed = Resources(workers=(Worker(name="g0", device="cuda", gpus=1, memory_bytes=1 << 30, host="h"),
                               Worker(name="g1", device="cuda", gpus=1, memory_bytes=1 << 30, host="h"),
                               Worker(name="c0", memory_bytes=1 << 30, host="h"),
                               Worker(name="c1", memory_bytes=1 << 30, host="h")))
    plan = with_devices(_plan(mixed), mixed, "auto")
    kinds = {w: d for st in plan.stages for w, d in zip(st.workers, st.devices, strict=True)}
    assert kinds == {"g0": "cuda", "g1": "cuda", "c0": "cpu", "c1": "cpu"}
    rows = {st.index: st.device for st in plan.stages}
    text = str(plan)
    assert "device" in text.splitlines()[3]  # the table's header
    for st in plan.stages:  # each stage's row shows the kinds its workers run it on
        row = next(line for line in text.splitlines() if re.match(rf"\s+{st.index}\s+n", line))
        assert f" {rows[st.index]}  {', '.join(st.workers)}" in row, row
    assert Plan.from_json(plan.to_json()) == plan
    on_cpu = with_devices(plan, mixed, "cpu")
    assert {d for st in on_cpu.stages for d in st.devices} == {"cpu"} and on_cpu.stages[0].device == "cpu"
    with pytest.raises(DeviceError, match="worker c0 has no GPU"):
        with_devices(plan, mixed, "cuda")


def test_a_plan_whose_devices_do_not_match_its_workers_is_refused() -> None:
    plan = _plan(Resources.local(4, memory_bytes=1 << 30)).model_dump()
    plan["stages"][0]["devices"] = ["cpu"]
    with pytest.raises(ValueError, match="stage 0: 1 devices for 2 workers"):
        Plan.model_validate(plan)
