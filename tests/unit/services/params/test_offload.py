"""The host copy of an offloaded optimizer (services/params/offload.py): a step on the masters equals the same
optimizer's step on the tensors themselves, and the masters are copies, not the tensors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from services.params.offload import HostCopy, master_dtype


def tensors(dtype: torch.dtype = torch.float64) -> list[tuple[str, nn.Parameter]]:
    gen = torch.Generator().manual_seed(0)
    shapes = {"w": (4, 3), "b": (4,), "s": ()}
    return [(n, nn.Parameter(torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)))
            for n, shape in shapes.items()]


def set_grads(params: list[tuple[str, nn.Parameter]], step: int, skip: str = "") -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for n, p in params:
        p.grad = None if n == skip else torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype)


@pytest.mark.parametrize("name", ["SGD", "AdamW"])
def test_steps_on_the_masters_equal_steps_on_the_tensors(name: str) -> None:
    kwargs = {"lr": 0.1, "momentum": 0.9} if name == "SGD" else {"lr": 0.01, "weight_decay": 0.1}
    direct, offloaded = tensors(), tensors()
    ref = getattr(torch.optim, name)([p for _, p in direct], **kwargs)
    host = HostCopy(offloaded)
    opt = getattr(torch.optim, name)([m for _, m in host.masters()], **kwargs)
    for step in range(4):
        for params in (direct, offloaded):  # "b" gets no gradient at step 2: neither side moves it
            set_grads(params, step, skip="b" if step == 2 else "")
        ref.step()
        host.pull_grads()
        opt.step()
        host.push_params()
    for (n, a), (_, b) in zip(direct, offloaded, strict=True):
        assert torch.equal(a, b), n
    state = host.device_state(opt).state
    assert set(map(id, state)) == {id(p) for _, p in offloaded}  # keyed by the device tensors
    for (_, d), (_, o) in zip(direct, offloaded, strict=True):
        for key, value in ref.state[d].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(state[o][key])), key


def test_the_masters_are_copies_and_the_gradients_are_read_in_place_on_the_cpu() -> None:
    params = tensors()
    host = HostCopy(params)
    for (_, p), (_, m) in zip(params, host.masters(), strict=True):
        assert m.data_ptr() != p.data_ptr() and torch.equal(m, p.detach())
    set_grads(params, 0)
    host.pull_grads()
    for (_, p), (_, m) in zip(params, host.masters(), strict=True):
        assert m.grad is not None and p.grad is not None and m.grad.data_ptr() == p.grad.data_ptr()
    assert host.host_bytes() == sum(p.numel() * 8 for _, p in params)  # the masters, no gradient buffers


def test_a_16_bit_tensor_gets_a_float32_master_and_a_float32_gradient_buffer() -> None:
    assert (master_dtype(torch.bfloat16), master_dtype(torch.float16)) == (torch.float32, torch.float32)
    assert (master_dtype(torch.float32), master_dtype(torch.float64)) == (torch.float32, torch.float64)
    params = tensors(torch.bfloat16)
    host = HostCopy(params)
    assert {m.dtype for _, m in host.masters()} == {torch.float32}
    set_grads(params, 0)
    host.pull_grads()
    for (_, p), (_, m) in zip(params, host.masters(), strict=True):
        assert m.grad is not None and p.grad is not None
        assert m.grad.dtype == torch.float32 and torch.equal(m.grad, p.grad.float())
        m.sub_(m.grad)
    host.push_params()
    for (_, p), (_, m) in zip(params, host.masters(), strict=True):
        assert torch.equal(p.detach(), m.to(torch.bfloat16))
