"""Placing stages on devices: each worker's device from the plan and its card, each group's backend, the clear
errors before any step; the local workers' GPUs and the profile's device."""

from __future__ import annotations

import logging

import pytest
import torch

from coordinator.planning.config import Device, PlanConfig, RuntimeConfig
from coordinator.planning.devices import DeviceError, with_devices
from coordinator.planning.plan import Plan
from coordinator.planning.planner import choose_plan
from coordinator.planning.profile import Profile
from coordinator.planning.resources import Resources, Worker
from coordinator.runtime.devices import DeviceRequest, local_resources, place_devices, profile_device
from coordinator.runtime.job import Job
from services.protocol import WorkerCard

MiB = 2**20
M = "tests.multiproc.coordinator.models"


def _card(name: str, gpus: int, local_rank: int | None = None) -> WorkerCard:
    return WorkerCard(name=name, address="tcp://127.0.0.1:1", pid=1, cpus=1, memory_bytes=0, gpus=gpus,
                      local_rank=local_rank)


def _gpu(name: str, host: str | None = "h") -> Worker:
    return Worker(name=name, device="cuda", gpus=1, memory_bytes=1 << 30, host=host)


def _cpu(name: str, host: str | None = "h") -> Worker:
    return Worker(name=name, memory_bytes=1 << 30, host=host)


def _plan(resources: Resources, d: int, p: int, setting: Device = "auto") -> Plan:
    profile = Profile.synthetic([1e-3] * 4, param_bytes=[MiB] * 4, activation_bytes=[MiB] * 4,
                                cut_bytes=[1024] * 3, microbatch_size=4)
    plan = choose_plan(profile, resources, PlanConfig(data_parallel=d, num_stages=p), global_batch=16)
    return with_devices(plan, resources, setting)


def _request(resources: Resources, **runtime: object) -> DeviceRequest:
    return DeviceRequest.of(RuntimeConfig.model_validate(runtime), resources)


def test_gpu_workers_run_on_their_local_rank_and_auto_picks_nccl_for_groups_all_on_cuda() -> None:
    res = Resources(workers=tuple(_gpu(f"w{i}") for i in range(4)))
    plan = _plan(res, 2, 2)
    cards = {f"w{i}": _card(f"w{i}", 4) for i in range(4)}
    placed = place_devices(plan, _request(res), cards)
    assert placed.devices == {"w0": "cuda:0", "w1": "cuda:1", "w2": "cuda:2", "w3": "cuda:3"}  # index on host
    assert placed.pipeline == ("nccl", "nccl") and placed.data_parallel == ("nccl", "nccl")
    assert "w0 cuda:0" in str(placed) and "pipelines r0 nccl" in str(placed)


def test_a_workers_own_local_rank_wins_over_its_index_on_the_host() -> None:
    res = Resources(workers=(_gpu("a"), _gpu("b")))
    cards = {"a": _card("a", 2, local_rank=1), "b": _card("b", 2, local_rank=0)}
    assert place_devices(_plan(res, 1, 2), _request(res), cards).devices == {"a": "cuda:1", "b": "cuda:0"}
    alone = Resources(workers=(_gpu("a", host=None), _gpu("b", host=None)))  # pods: each a machine of its own
    cards = {"a": _card("a", 1), "b": _card("b", 1)}
    assert place_devices(_plan(alone, 1, 2), _request(alone), cards).devices == {"a": "cuda:0", "b": "cuda:0"}


def test_a_mixed_pipeline_stages_through_the_cpu_backend_and_the_groups_choose_separately() -> None:
    res = Resources(workers=(_gpu("g0"), _gpu("g1"), _cpu("c0"), _cpu("c1")))
    plan = _plan(res, 2, 2)
    cards = {"g0": _card("g0", 2), "g1": _card("g1", 2), "c0": _card("c0", 0), "c1": _card("c1", 0)}
    placed = place_devices(plan, _request(res), cards)
    assert placed.devices == {"g0": "cuda:0", "g1": "cuda:1", "c0": "cpu", "c1": "cpu"}
    pipes = {tuple(placed.devices[w] for w in row): b for row, b in zip(plan.placement, placed.pipeline,
                                                                        strict=True)}
    for devices, backend in pipes.items():  # a pipeline all on GPUs gets NCCL, one with a CPU member zmq
        assert backend == ("nccl" if all(d.startswith("cuda") for d in devices) else "zmq"), pipes
    assert placed.data_parallel == ("zmq", "zmq")  # each stage has a GPU replica and a CPU one
    gloo = place_devices(plan, _request(res, comm_backend="gloo", data_parallel_backend="zmq"), cards)
    assert set(gloo.pipeline) == {"gloo"} and gloo.data_parallel == ("zmq", "zmq")  # per group
    with pytest.raises(DeviceError, match=r"runtime.data_parallel_backend is 'nccl' but the data-parallel "
                                          r"group of stage 0 has worker\(s\) c\d on the CPU, and NCCL moves "
                                          r"CUDA tensors only: set runtime.data_parallel_backend to auto"):
        place_devices(plan, _request(res, data_parallel_backend="nccl"), cards)


def test_cpu_workers_get_zmq_from_auto_and_an_explicit_cpu_backend_as_asked() -> None:
    res = Resources.local(4, memory_bytes=1 << 30)
    plan = _plan(res, 2, 2)
    cards = {w.name: _card(w.name, 0) for w in res.workers}
    placed = place_devices(plan, _request(res), cards)
    assert set(placed.devices.values()) == {"cpu"} and set(placed.pipeline + placed.data_parallel) == {"zmq"}
    gloo = place_devices(plan, _request(res, pipeline_backend="gloo"), cards)
    assert gloo.pipeline == ("gloo", "gloo") and gloo.data_parallel == ("zmq", "zmq")
    with pytest.raises(DeviceError, match=r"pipeline_backend is 'nccl' but the pipeline of replica 0"):
        place_devices(plan, _request(res, comm_backend="nccl"), cards)


def test_a_one_member_group_forms_no_communicator_and_takes_its_devices_backend() -> None:
    res = Resources(workers=(_gpu("g0"), _cpu("c0")))
    plan = _plan(res, 2, 1)  # two one-stage pipelines: no pipeline communicator
    cards = {"g0": _card("g0", 1), "c0": _card("c0", 0)}
    placed = place_devices(plan, _request(res, pipeline_backend="nccl", data_parallel_backend="zmq"), cards)
    assert {placed.devices[row[0]]: b for row, b in zip(plan.placement, placed.pipeline, strict=True)} == {
        "cuda:0": "nccl", "cpu": "zmq"}


def test_a_gpu_worker_whose_process_has_no_cuda_is_refused_under_cuda_and_runs_on_cpu_under_auto(
        caplog: pytest.LogCaptureFixture) -> None:
    res = Resources(workers=(_gpu("a"), _gpu("b")))
    cards = {"a": _card("a", 1, local_rank=0), "b": _card("b", 0, local_rank=0)}
    with pytest.raises(DeviceError, match=r"worker b: runtime.device is 'cuda' but its process sees no CUDA "
                                          r"device \(torch.cuda.is_available\(\) is False there"):
        place_devices(_plan(res, 1, 2, "cuda"), _request(res, device="cuda"), cards)
    with caplog.at_level(logging.WARNING):
        placed = place_devices(_plan(res, 1, 2), _request(res), cards)
    assert placed.devices == {"a": "cuda:0", "b": "cpu"} and placed.pipeline == ("zmq",)
    assert "worker b: the resource list gives it GPUs but its process sees no CUDA device" in caplog.text


def test_a_local_rank_beyond_the_devices_and_two_workers_on_one_gpu_are_refused_naming_them() -> None:
    res = Resources(workers=(_gpu("a"), _gpu("b"), _gpu("c")))
    cards = {"a": _card("a", 2), "b": _card("b", 2), "c": _card("c", 2)}
    with pytest.raises(DeviceError, match=r"worker c: LOCAL_RANK 2 \(its index among the resource list's "
                                          r"workers on host h\), but its process sees 2 CUDA device\(s\)"):
        place_devices(_plan(res, 1, 3), _request(res), cards)
    cards = {"a": _card("a", 2, local_rank=3), "b": _card("b", 2), "c": _card("c", 2)}
    with pytest.raises(DeviceError, match=r"worker a: LOCAL_RANK 3 \(its LOCAL_RANK\)"):
        place_devices(_plan(res, 1, 3), _request(res), cards)
    cards = {name: _card(name, 2, local_rank=rank) for name, rank in (("a", 1), ("b", 1), ("c", 0))}
    with pytest.raises(DeviceError, match="workers a and b would both run on cuda:1 of host h"):
        place_devices(_plan(res, 1, 3), _request(res), cards)


def test_local_workers_are_cpu_workers_without_gpus_and_cuda_then_is_refused() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert all(w.device == "cpu" for w in local_resources(RuntimeConfig(workers=3)).workers)
    assert local_resources(RuntimeConfig(workers=2, device="cpu")) == Resources.local(2)
    with pytest.raises(DeviceError, match=r"runtime.device is 'cuda' but this machine's torch sees no CUDA"):
        local_resources(RuntimeConfig(workers=2, device="cuda"))


def test_local_workers_take_a_gpu_each_when_there_are_enough(monkeypatch: pytest.MonkeyPatch) -> None:
    class Props:
        total_memory = 16 << 30

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props())
    two = local_resources(RuntimeConfig(workers=2))
    assert [(w.name, w.device, w.gpus) for w in two.workers] == [("local-0", "cuda", 1),
                                                                 ("local-1", "cuda", 1)]
    assert all(w.device == "cpu" for w in local_resources(RuntimeConfig(workers=3)).workers)  # too few: CPUs
    assert all(w.device == "cpu" for w in local_resources(RuntimeConfig(workers=2, device="cpu")).workers)
    with pytest.raises(DeviceError, match="the 3 local workers need a GPU each, and this machine's"):
        local_resources(RuntimeConfig(workers=3, device="cuda"))


def test_the_profile_runs_where_the_workers_will_and_says_when_it_cannot(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    gpus = Resources(workers=(_gpu("a"), _gpu("b")))
    assert profile_device(Resources.local(2), "auto") == torch.device("cpu")
    assert profile_device(gpus, "cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level(logging.WARNING):
        assert profile_device(gpus, "auto") == torch.device("cpu")
    assert "the workers run on CUDA but this coordinator has no CUDA: the profile is the CPU's" in caplog.text
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert profile_device(gpus, "auto") == torch.device("cuda", 0)
    with pytest.raises(DeviceError, match="worker local-0 has no GPU"):
        profile_device(Resources.local(2), "cuda")


def test_a_jobs_plan_shows_where_its_stages_run(caplog: pytest.LogCaptureFixture) -> None:
    gpus = Resources(workers=(_gpu("local-0"), _gpu("local-1")))
    fields: dict[str, object] = dict(model=f"{M}:mlp", data=f"{M}:regression", loss=f"{M}:mse",
                                     global_batch=8, num_stages=2, data_parallel=1)
    with caplog.at_level(logging.WARNING):
        plan = Job(resources=gpus, **fields).plan()
    assert [st.devices for st in plan.stages] == [("cuda",), ("cuda",)] and " cuda  local-0" in str(plan)
    if not torch.cuda.is_available():
        assert "the profile is the CPU's" in caplog.text
    assert [st.devices for st in Job(resources=gpus, device="cpu", **fields).plan().stages] == [("cpu",)] * 2
    with pytest.raises(DeviceError, match="worker local-0 has no GPU in the resource list"):
        Job(resources=Resources.local(2), device="cuda", **fields).plan()
    spec = Job(resources=gpus, pipeline_backend="gloo", **fields).run_spec("workers", "run-1").devices
    assert (spec.setting, spec.pipeline_backend, spec.data_parallel_backend) == ("auto", "gloo", "auto")
    assert spec.local_ranks == {"local-0": 0, "local-1": 1}
