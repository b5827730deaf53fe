"""BatchNorm over replicas: two replicas' halves normalise, update and backpropagate as one batch does."""

from __future__ import annotations

import copy
import threading
from datetime import timedelta

import pytest
import torch
from torch import nn

from comm.base import CompletedWork, ReduceOp, Work
from services.compute.batchnorm import BatchNormSync, batch_norm_layers
from services.compute.cell import as_cells


class _Pair:
    """A group of two threads summing tensors (what an all-reduce over two replicas returns)."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(2)
        self.slots: list[torch.Tensor | None] = [None, None]


class _Member:
    """One replica's communicator over a :class:`_Pair` (only what BatchNormSync calls)."""

    world_size = 2

    def __init__(self, pair: _Pair, rank: int) -> None:
        self.pair, self.rank = pair, rank
        self.calls = 0

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, *,
                   timeout: timedelta | None = None, async_op: bool = False) -> Work:
        assert op is ReduceOp.SUM
        self.calls += 1
        self.pair.slots[self.rank] = tensor.clone()
        self.pair.barrier.wait(10)
        total = sum(t for t in self.pair.slots if t is not None)
        self.pair.barrier.wait(10)
        tensor.copy_(total)
        return CompletedWork()


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3), nn.Tanh(), nn.Flatten(),
                         nn.Linear(48, 4), nn.BatchNorm1d(4, momentum=None)).double()


def test_two_replicas_train_batch_norm_as_one_process_over_their_batch() -> None:
    x = torch.randn(8, 2, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    target = torch.randn(8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    one = _model()
    for _ in range(2):  # two steps: num_batches_tracked and the cumulative average move twice
        one.zero_grad()
        ref_out = one(x)
        ((ref_out - target) ** 2).mean().backward()  # type: ignore[no-untyped-call]
    replicas = [copy.deepcopy(_model()) for _ in range(2)]
    pair = _Pair()
    members = [_Member(pair, r) for r in range(2)]
    syncs = [BatchNormSync(m, lambda r=r: members[r]) for r, m in enumerate(replicas)]  # type: ignore[misc]
    outputs: list[torch.Tensor | None] = [None, None]

    def train(r: int) -> None:
        share = slice(4 * r, 4 * r + 4)
        for _ in range(2):
            replicas[r].zero_grad()
            out = replicas[r](x[share])
            ((out - target[share]) ** 2).mean().backward()  # the replica's mean loss, as the executor's
            outputs[r] = out.detach()

    threads = [threading.Thread(target=train, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert members[0].calls == members[1].calls == 8  # 2 layers x (forward + backward) x 2 steps
    assert syncs[0].deadline is None and syncs[0].reduced
    assert outputs[0] is not None and outputs[1] is not None
    syncs[0].begin(123.0)
    assert (syncs[0].deadline, syncs[0].reduced) == (123.0, False)
    torch.testing.assert_close(torch.cat([outputs[0], outputs[1]]), ref_out.detach(), rtol=0, atol=1e-12)
    for name, ref in one.state_dict().items():
        for replica in replicas:
            torch.testing.assert_close(replica.state_dict()[name], ref, rtol=0, atol=1e-12, msg=name)
    for (name, p), p0, p1 in zip(one.named_parameters(), replicas[0].parameters(), replicas[1].parameters(),
                                 strict=True):
        assert p.grad is not None and p0.grad is not None and p1.grad is not None
        torch.testing.assert_close((p0.grad + p1.grad) / 2, p.grad, rtol=0, atol=1e-12, msg=name)
    assert int(replicas[0][1].num_batches_tracked) == 2


def test_in_eval_mode_or_without_a_group_it_is_torchs_batch_norm() -> None:
    model, plain = _model(), _model()
    BatchNormSync(model, lambda: None)
    x = torch.randn(6, 2, 4, 4, dtype=torch.float64)
    torch.testing.assert_close(model(x), plain(x), rtol=0, atol=0)
    model.train(False)
    plain.train(False)
    torch.testing.assert_close(model(x), plain(x), rtol=0, atol=0)


def test_a_step_past_its_deadline_names_the_layer() -> None:
    model = _model()
    sync = BatchNormSync(model, lambda: _Member(_Pair(), 0))
    sync.deadline = 0.0
    with pytest.raises(TimeoutError, match=r"BatchNorm statistics of layer '1' \(forward\)"):
        model(torch.randn(4, 2, 4, 4, dtype=torch.float64))


def test_layers_are_named_as_the_model_names_them() -> None:
    made = [nn.Conv2d(1, 2, 1), nn.Sequential(nn.BatchNorm2d(2), nn.ReLU()), nn.BatchNorm2d(2)]
    cells = as_cells(made)
    assert batch_norm_layers(nn.Sequential(*cells[1:])) == ["1.0 (BatchNorm2d)", "2 (BatchNorm2d)"]
    assert batch_norm_layers(nn.Sequential(*cells[:1])) == []


def test_a_frozen_batch_norm_couples_no_samples() -> None:
    model = _model()
    model[1].train(False)
    assert batch_norm_layers(model) == ["5 (BatchNorm1d)"]
