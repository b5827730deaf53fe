"""The backend of a group from its members' devices ([Note: a group's backend] in comm/factory.py)."""

from __future__ import annotations

import pytest
import torch

from comm.factory import resolve_backend, wire_device


@pytest.mark.parametrize(("backend", "devices", "expected"), [
    ("auto", ["cuda:0", "cuda:1"], "nccl"),  # every member on a GPU
    ("auto", ["cpu", "cpu"], "zmq"),  # the CPU backend
    ("auto", ["cuda:0", "cpu"], "zmq"),  # a mixed group stages through host memory
    ("gloo", ["cuda:0", "cuda:1"], "gloo"),  # asked for explicitly: GPUs stage through host memory
    ("zmq", ["cpu"], "zmq"),
    ("nccl", ["cuda:0", "cuda:3"], "nccl"),
])
def test_a_groups_backend_follows_its_members_devices(backend: str, devices: list[str],
                                                      expected: str) -> None:
    assert resolve_backend(backend, devices) == expected


def test_nccl_for_a_group_with_a_cpu_member_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match=r"nccl backend moves CUDA tensors, but member\(s\) \[1\] .* CPU"):
        resolve_backend("nccl", ["cuda:0", "cpu"])


def test_an_unknown_backend_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown communication backend 'mpi'"):
        resolve_backend("mpi", ["cpu"])


@pytest.mark.parametrize(("backend", "device", "wire"), [
    ("nccl", "cuda:1", "cuda:1"),  # NCCL takes device tensors
    ("zmq", "cuda:1", "cpu"),  # zmq and gloo take CPU tensors: a GPU member stages
    ("gloo", "cuda:0", "cpu"),
    ("zmq", "cpu", "cpu"),
])
def test_the_wire_device_is_the_gpu_only_for_nccl(backend: str, device: str, wire: str) -> None:
    assert wire_device(backend, device) == torch.device(wire)
