"""The weight-gradient store: I then W (batched or per microbatch) gives what plain autograd gives.

The reference is plain autograd on the same module and microbatches (float64): each microbatch's
backward accumulating into ``.grad``. A one-stage compute service runs a zb-h1 list and a 1F1B list
(its B's in between computing their weight gradients in place) through the executor and matches
the same reference as its GPipe list.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from comm.rpc import RpcClient
from services.compute import weight_grads
from services.compute.weight_grads import WeightGradStore, eligible_layers, in_place_backwards
from services.protocol import Action, CommitStep, Empty, OptimizerSpec, RunStep, StepReply, TensorsReply
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



def actions(text: str) -> list[Action]:
    return [Action.parse(t) for t in text.split()]


@pytest.mark.parametrize(("text", "zero_grad", "expected"), [
    ("0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3", True, {1, 2}),  # 1F1B: the B's between the first and the last
    ("0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3", False, {0, 1, 2}),  # gradients there already: the first one too
    ("0F0 0B0 0F1 0B1", True, set()),  # nothing in between
    ("0F0 0B0", False, set()),  # one B: the step's last
    ("0F0 0F1 0F2 0B2 0B1 0B0", False, set()),  # GPipe defers all of them
    ("0F0 0I0 0W0 0F1 0I1 0W1", False, set()),  # zb-h1 splits its own
])
def test_the_b_s_in_between_compute_their_weight_gradients_in_place(text: str, zero_grad: bool,
                                                                      expected: set[int]) -> None:
    assert in_place_backwards(actions(text), zero_grad) == expected


def one_f_one_b(net: nn.Module, xs: list[torch.Tensor], gs: list[torch.Tensor], zero_grad: bool,
                outside_use: bool = False) -> None:
    """What the executor runs for a 1F1B list of 4 microbatches: the in-between B's are I and at once their
    W; a parameter's .grad stays the same tensor across an in-place W and no hook fires for it (unless the
    weight is also used outside its layer: that part comes through autograd, as in a plain B)."""
    fired: list[str] = []
    for n, p in net.named_parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda p, n=n: fired.append(n))  # type: ignore[misc]
    text = "0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3"
    in_place = in_place_backwards(actions(text), zero_grad)
    assert in_place == ({1, 2} if zero_grad else {0, 1, 2})
    store = WeightGradStore(net)
    outs: dict[int, torch.Tensor] = {}
    with store.deferring():
        for a in actions(text):
            m = a.microbatch
            if a.kind == "F":
                store.microbatch = m if m in in_place else None
                outs[m] = net(xs[m])
                continue
            held = net.a.weight.grad
            fired.clear()
            outs.pop(m).backward(gs[m])
            if m in in_place:
                store.flush([m], check=False)
                assert store.pending() == []  # nothing held across actions
                if held is not None:
                    assert net.a.weight.grad is held  # added in place
                    assert outside_use or "a.weight" not in fired  # no hook
            else:
                assert "a.weight" in fired  # plain autograd: the hook fires (the last B: armed)


@pytest.mark.parametrize("zero_grad", [True, False], ids=["from-none", "onto-earlier-gradients"])
def test_b_s_in_place_equal_plain_autograd(zero_grad: bool) -> None:
    net, xs, gs = make()
    before = {n: torch.zeros_like(p) for n, p in net.named_parameters()}
    if not zero_grad:
        for n, p in net.named_parameters():  # gradients from an earlier batch
            if p.requires_grad:
                before[n] = torch.full_like(p, 0.5)
                p.grad = before[n].clone()
    one_f_one_b(net, xs, gs, zero_grad)
    expected = plain()
    got = grads(net, xs)
    assert got.keys() == expected.keys()
    assert max(float((got[k] - before.get(k, 0) - expected[k]).abs().max()) for k in expected) < TOL


def test_b_s_in_place_take_a_weight_also_used_outside_its_layer() -> None:
    class Reuse(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(5, 5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(x) + x @ self.a.weight  # a functional use of the layer's weight

    def run(split: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        net = Reuse().double()
        xs = [torch.randn(3, 5, dtype=torch.float64, requires_grad=True) for _ in range(4)]
        gs = [torch.randn(3, 5, dtype=torch.float64) for _ in range(4)]
        if split:
            one_f_one_b(net, xs, gs, True, outside_use=True)
        else:
            for x, g in zip(xs, gs, strict=True):
                net(x).backward(g)
        return grads(net, xs)

    assert max_diff(run(True), run(False)) < TOL


def test_a_one_stage_1f1b_list_matches_one_process(one_stage: RpcClient) -> None:
    text = "0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3"
    weight_grads._STORES.clear()
    reply, _ = one_stage.call("c", "run_step", RunStep(step=0, microbatches=MICROBATCHES_4,
                                                       actions=parse_actions(text)), StepReply)
    _, got = one_stage.call("c", "gradients", Empty(), TensorsReply)
    assert len(weight_grads._STORES) == 1  # the B's in between split
    grads_ref, _, losses_ref = reference("skip_model")
    assert max(float((got[k] - grads_ref[k]).abs().max()) for k in grads_ref) < 1e-10
    assert max(abs(a - b) for a, b in zip(reply.losses, losses_ref, strict=True)) < 1e-10


@pytest.mark.parametrize(("share", "flushes"), [(1e-6, [[0, 1, 2, 3]]),
                                                (weight_grads.HOLD_SHARE, [[0], [1], [2], [3]])],
                         ids=["held-together", "each-at-once"])
def test_the_b_s_of_a_replica_alone_hold_their_w_and_compute_them_in_one_flush(
        one_stage: RpcClient, monkeypatch: pytest.MonkeyPatch, share: float, flushes: list[list[int]],
) -> None:
    """A 1F1B list of a replica alone (no hook waits for a parameter's last contribution): every B holds its
    W, and they are computed in one flush after the last B while their rows hold at most 1/HOLD_SHARE of the
    weights' bytes; past it, each at once (this model's 3 x 3 layers at 4 rows: one microbatch's rows are
    more than 1/8 of the weights). The step's gradients stay those of one process either way."""
    from services.compute import executor

    seen: list[list[int]] = []
    real = WeightGradStore.flush

    def flush(self: WeightGradStore, microbatches: list[int] | None = None, **kw: bool) -> None:
        seen.append(list(microbatches) if microbatches is not None else [-1])
        real(self, microbatches, **kw)

    monkeypatch.setattr(WeightGradStore, "flush", flush)
    monkeypatch.setattr(executor, "HOLD_SHARE", share)
    text = "0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3"
    reply, _ = one_stage.call("c", "run_step", RunStep(step=0, microbatches=MICROBATCHES_4,
                                                       actions=parse_actions(text)), StepReply)
    _, got = one_stage.call("c", "gradients", Empty(), TensorsReply)
    assert seen == flushes
    grads_ref, _, losses_ref = reference("skip_model")
    assert max(float((got[k] - grads_ref[k]).abs().max()) for k in grads_ref) < 1e-10
    assert max(abs(a - b) for a, b in zip(reply.losses, losses_ref, strict=True)) < 1e-10


def test_a_lone_replica_holds_its_zero_bubble_w_s_for_the_last_run(
        one_stage: RpcClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """Within the share, W0 and W1 are held (timed as nothing) and the run after the last I computes all four
    microbatches' at once; the gradients stay those of one process."""
    from services.compute import executor

    monkeypatch.setattr(executor, "HOLD_SHARE", 1e-6)
    text = "0F0 0I0 0W0 0F1 0I1 0W1 0F2 0I2 0F3 0I3 0W2 0W3"
    reply, _ = one_stage.call("c", "run_step", RunStep(step=0, microbatches=MICROBATCHES_4,
                                                       actions=parse_actions(text)), StepReply)
    _, got = one_stage.call("c", "gradients", Empty(), TensorsReply)
    assert reply.ends[2] == reply.starts[2] and reply.ends[5] == reply.starts[5]  # held
    assert reply.ends[11] > reply.starts[10]  # the last run computed them
    grads_ref, _, losses_ref = reference("skip_model")
    assert max(float((got[k] - grads_ref[k]).abs().max()) for k in grads_ref) < 1e-10
    assert max(abs(a - b) for a, b in zip(reply.losses, losses_ref, strict=True)) < 1e-10


def steps_from_no_gradients(store: WeightGradStore, net: Net, xs: list[torch.Tensor], gs: list[torch.Tensor],
                            count: int, keep: list[torch.Tensor]) -> list[dict[str, int]]:
    """``count`` steps, each from no gradients (as the executor's ``zero_grad``): forwards and I of every
    microbatch, then one final flush; per step the address of each deferred weight's gradient. ``keep``
    gets each step's ``a.weight.grad`` after the first (a reference held elsewhere)."""
    addresses = []
    for step in range(count):
        for p in net.parameters():
            p.grad = None
        with store.deferring():
            for i, (x, g) in enumerate(zip(xs, gs, strict=True)):
                x.grad = None
                store.microbatch = i
                net(x).backward(g)
            store.flush(None, final=True)
        addresses.append({n: net.get_submodule(n).weight.grad.data_ptr() for n in store.layers})
        if step >= 1:
            keep.append(net.a.weight.grad)
    return addresses


def test_a_flush_from_no_gradients_hands_its_products_over_and_writes_them_again_next_step() -> None:
    net, xs, gs = make()
    fired: list[str] = []
    for n, p in net.named_parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda p, n=n: fired.append(n))  # type: ignore[misc]
    store = WeightGradStore(net)
    keep: list[torch.Tensor] = []
    addresses = steps_from_no_gradients(store, net, xs, gs, 4, keep)
    expected = plain()
    assert max_diff(grads(net, xs), expected) < TOL  # the last step's gradients are autograd's
    # each deferred parameter's hook fired once a step (b is called twice a forward: still one contribution)
    deferred = ["a.bias", "a.weight", "b.weight", "out.bias", "out.weight"]
    assert sorted(n for n in fired if n in deferred) == sorted(deferred * 4)
    # step 2 writes into the tensors step 1 handed over (no copy, no fresh memory); step 2's a.weight
    # gradient, held by a name from then on, is left alone: steps 3 and 4 make a new one for a, the rest reuse
    assert addresses[1] == addresses[0]
    assert addresses[2]["a"] != addresses[1]["a"] and addresses[2]["b"] == addresses[1]["b"]
    assert max(float((k - expected["a.weight"]).abs().max()) for k in keep) < TOL  # none was overwritten


def test_a_lone_replica_s_next_step_writes_its_flush_into_the_gradients_it_handed_over(
        one_stage: RpcClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three steps of a lone replica's 1F1B list, each from no gradients and the later ones carrying the
    previous step's commit (the fused SGD at lr 0: the parameters stay): the first flush makes each deferred
    weight's gradient, the next ones write into the same tensors (nothing holds them after the step's
    reply, the gradients' read and the optimizer's step); every step's gradients are one process's."""
    reused: list[bool] = []  # per product of a flush from no gradients: written into the one handed over
    real = WeightGradStore._product

    def product(self: WeightGradStore, index: int, g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        spare = id(self._spares.get(index))  # its identity only: a reference would keep it from reuse
        out = real(self, index, g, x)
        reused.append(id(out) == spare)
        return out

    monkeypatch.setattr(WeightGradStore, "_product", product)
    weight_grads._STORES.clear()
    text = "0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3"
    grads_ref, _, _ = reference("skip_model")
    for step in range(3):
        still = OptimizerSpec(name="SGD", kwargs={"lr": 0.0})
        commit = CommitStep(step=step - 1, optimizer=still) if step else None
        one_stage.call("c", "run_step", RunStep(step=step, microbatches=MICROBATCHES_4, commit=commit,
                                                actions=parse_actions(text)), StepReply)
        _, got = one_stage.call("c", "gradients", Empty(), TensorsReply)
        assert max(float((got[k] - grads_ref[k]).abs().max()) for k in grads_ref) < 1e-10
    (store,) = weight_grads._STORES.values()
    assert len(store.layers) == 5 and reused == [False] * 5 + [True] * 10
