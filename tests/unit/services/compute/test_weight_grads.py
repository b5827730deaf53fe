"""The weight-gradient store: I then W (batched or per microbatch) gives what plain autograd gives.

The reference is plain autograd on the same module and microbatches (float64): each microbatch's
backward accumulating into ``.grad``. A one-stage compute service runs a zb-h1 list through the
executor and matches the same reference as its GPipe list.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from comm.rpc import RpcClient
from services.compute import weight_grads
from services.compute.weight_grads import WeightGradStore, eligible_layers
from services.protocol import Empty, RunStep, StepReply, TensorsReply
from tests.unit.services.compute.test_compute_parts import MICROBATCHES_4, one_stage, parse_actions, reference

__all__ = ["one_stage"]  # the fixture, used here too

TOL = 1e-12


class Net(nn.Module):
    """Linear layers on 3-d inputs, one called twice, a LayerNorm, a frozen layer and two tied ones."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 7)
        self.norm = nn.LayerNorm(7)
        self.b = nn.Linear(7, 7, bias=False)  # called twice
        self.frozen = nn.Linear(7, 7)
        self.frozen.requires_grad_(False)
        self.tied1, self.tied2 = nn.Linear(7, 7), nn.Linear(7, 7)
        self.tied2.weight = self.tied1.weight
        self.out = nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.b(torch.tanh(self.b(self.norm(self.a(x)))))
        h = torch.tanh(self.tied2(self.tied1(self.frozen(h))))
        return self.out(h)


def make() -> tuple[Net, list[torch.Tensor], list[torch.Tensor]]:
    torch.manual_seed(0)
    net = Net().double()
    xs = [torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True) for _ in range(4)]
    gs = [torch.randn(3, 4, 3, dtype=torch.float64) for _ in range(4)]
    return net, xs, gs


def grads(net: nn.Module, xs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
    out.update({f"x{i}": x.grad.clone() for i, x in enumerate(xs) if x.grad is not None})
    return out


def plain() -> dict[str, torch.Tensor]:
    net, xs, gs = make()
    for x, g in zip(xs, gs, strict=True):
        net(x).backward(g)
    return grads(net, xs)


def split(flushes: list[list[int] | None]) -> tuple[dict[str, torch.Tensor], WeightGradStore]:
    """Forwards and I of every microbatch, then W flushed in the groups ``flushes`` names."""
    net, xs, gs = make()
    store = WeightGradStore(net)
    with store.deferring():
        for i, (x, g) in enumerate(zip(xs, gs, strict=True)):
            store.microbatch = i
            net(x).backward(g)
        queued = store.pending()
        assert queued == [0, 1, 2, 3]
        assert net.a.weight.grad is None and net.norm.weight.grad is not None  # I left the deferred ones
        assert all(x.grad is not None for x in xs)  # ... and made every input gradient
        for n, group in enumerate(flushes):
            store.flush(group, final=n == len(flushes) - 1)
        assert store.pending() == []
    assert "forward" not in net.out.__dict__  # the layers' own forwards are back
    return grads(net, xs), store


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_only_untied_trainable_plain_linear_layers_are_deferred() -> None:
    net, _, _ = make()
    assert [name for name, _ in eligible_layers(net)] == ["a", "b", "out"]
    assert [name for name, _ in eligible_layers(net.float())] == ["a", "b", "out"]
    assert eligible_layers(net.to(torch.bfloat16)) == []


@pytest.mark.parametrize("flushes", [[None], [[0], [1], [2], [3]], [[0, 1], [3, 2]], [[2], None]],
                         ids=["all-at-once", "per-microbatch", "pairs", "one-then-the-rest"])
def test_batched_and_per_microbatch_w_equal_plain_autograd(flushes: list[list[int] | None]) -> None:
    got, _ = split(flushes)
    assert max_diff(got, plain()) < TOL


def test_a_flush_adds_in_place_and_the_final_one_through_autograd_firing_each_hook_once() -> None:
    net, xs, gs = make()
    for p in net.parameters():  # gradients from an earlier batch
        p.grad = torch.ones_like(p) if p.requires_grad else None
    before = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
    fired: list[str] = []
    for n, p in net.named_parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda p, n=n: fired.append(n))  # type: ignore[misc]
    store = WeightGradStore(net)
    with store.deferring():
        for i, (x, g) in enumerate(zip(xs, gs, strict=True)):
            store.microbatch = i
            net(x).backward(g)
        fired.clear()
        held = net.a.weight.grad
        store.flush([0, 1])  # into the gradients there are, in place, without hooks
        assert fired == [] and net.a.weight.grad is held
        store.flush([2, 3], final=True)  # the last contribution: through autograd
    assert sorted(fired) == ["a.bias", "a.weight", "b.weight", "out.bias", "out.weight"]
    expected = plain()
    for n, p in net.named_parameters():
        if p.grad is not None:
            assert float((p.grad - before[n] - expected[n]).abs().max()) < TOL, n


def test_evaluation_and_autocast_forwards_are_not_deferred() -> None:
    net, xs, _ = make()
    store = WeightGradStore(net)
    with store.deferring():
        store.microbatch = 0
        with torch.no_grad():
            net(xs[0])
        net.float()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            net(xs[0].float()).float().sum().backward()
        assert store.pending() == []
        assert net.a.weight.grad is not None  # plain autograd made it
    assert store.pending() == []


def test_a_weight_also_used_outside_its_layer_is_named() -> None:
    class Reuse(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) + x @ self.lin.weight  # a functional use of the layer's weight

    net = Reuse().double()
    store = WeightGradStore(net)
    with store.deferring():
        store.microbatch = 0
        net(torch.randn(2, 4, dtype=torch.float64)).sum().backward()
        with pytest.raises(RuntimeError, match=r"'lin\.weight' is used by its nn\.Linear and outside it"):
            store.flush(None)


def test_a_one_stage_zero_bubble_list_matches_one_process(one_stage: RpcClient) -> None:
    text = "0F0 0I0 0W0 0F1 0I1 0W1 0F2 0I2 0F3 0I3 0W2 0W3"
    reply, _ = one_stage.call("c", "run_step", RunStep(step=0, microbatches=MICROBATCHES_4,
                                                       actions=parse_actions(text)), StepReply)
    _, got = one_stage.call("c", "gradients", Empty(), TensorsReply)
    stores = list(weight_grads._STORES.values())  # the service runs in this process: its store deferred
    assert stores and stores[-1].layers == ["stem.module.a", "stem.module.b", "mix.module.c",
                                           "merge.module.d", "head.module"]
    grads_ref, _, losses_ref = reference("skip_model")
    assert max(float((got[k] - grads_ref[k]).abs().max()) for k in grads_ref) < 1e-10
    assert max(abs(a - b) for a, b in zip(reply.losses, losses_ref, strict=True)) < 1e-10
    # the run W2 W3 is one flush, timed as two equal shares of it
    assert reply.starts[10] <= reply.ends[10] == reply.starts[11] <= reply.ends[11]
    assert reply.ends[11] - reply.starts[11] == pytest.approx(reply.ends[10] - reply.starts[10], abs=1e-6)

