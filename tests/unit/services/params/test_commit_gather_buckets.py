"""ZeRO-1/2's gather buckets: in forward order, the first ones small ([Note: the first buckets ramp up])."""

from __future__ import annotations

import torch
from torch import fx, nn

from services.params.commit_gather import POOL_PARAM_BYTES, RAMP_FLOOR, CommitGather, pool_small, ramp
from services.params.layout import ShardLayout

KIB = 1 << 10


def test_the_limit_doubles_from_a_sixteenth_to_gather_bytes_and_not_below_the_floor() -> None:
    assert [ramp(4 << 20, k) // KIB for k in range(7)] == [256, 512, 1024, 2048, 4096, 4096, 4096]
    assert [ramp(1 << 20, k) // KIB for k in range(6)] == [256, 256, 256, 512, 1024, 1024]
    assert {ramp(RAMP_FLOOR, k) for k in range(6)} == {RAMP_FLOOR}  # a floor's worth or less: no ramp
    assert {ramp(1000, k) for k in range(6)} == {1000}


def _buckets(layers: int, width: int, gather_bytes: int) -> list[int]:
    model = fx.symbolic_trace(nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)]))
    params = list(model.parameters())
    shards = {id(p): ShardLayout([p.shape], 2).shard_of(p.detach(), 0, 0) for p in params}
    gather = CommitGather(model, params, shards, 2, 0, gather_bytes)
    first = [id(p) for b in gather.buckets for p in b.params]
    assert first == [id(p) for p in params]  # forward order, every parameter once
    gather.close()
    return [sum(p.numel() * p.element_size() for p in b.params) for b in gather.buckets]


def test_the_first_buckets_are_small_and_grow_to_gather_bytes() -> None:
    """16 layers of 128 KiB (float32 181 x 181 is 128 KiB less a little) in buckets of up to 2 MiB: 2, 2,
    4 and 8 layers (up to 256, 256, 512 and 1024 KiB); without the ramp 2 MiB buckets from the start."""
    sizes = _buckets(16, 181, 2 << 20)
    layer = 181 * 181 * 4
    assert sizes == [2 * layer, 2 * layer, 4 * layer, 8 * layer], sizes
    assert all(s <= ramp(2 << 20, k) for k, s in enumerate(sizes))
    assert _buckets(16, 181, 1 << 40)[0] == 16 * layer  # one bucket, as large as the model
    assert _buckets(16, 181, RAMP_FLOOR) == [2 * layer] * 8  # no ramp



def test_tiny_buckets_are_pooled_first_and_large_parameters_stay_alone() -> None:
    """[Note: the small ones pooled]: the biases between large weights made a bucket (a collective) each."""
    layers = [nn.Linear(512, 512) for _ in range(4)]  # 1 MiB weights, 2 KiB biases
    model = fx.symbolic_trace(nn.Sequential(*layers, nn.LayerNorm(512)))
    params = list(model.parameters())
    shards = {id(p): ShardLayout([p.shape], 2).shard_of(p.detach(), 0, 0) for p in params}
    gather = CommitGather(model, params, shards, 2, 0, 1 << 20)
    small = [id(p) for p in params if p.numel() * p.element_size() < POOL_PARAM_BYTES]
    assert [id(p) for p in gather.buckets[0].params] == small  # 4 biases and the norm's 2, in forward order
    assert [[id(p) for p in b.params] for b in gather.buckets[1:]] == [[id(m.weight)] for m in layers]
    assert all(b.packs_as_itself() for b in gather.buckets[1:])  # so each is gathered in place
    gather.close()
    f32, f64 = torch.zeros(8), torch.zeros(8, dtype=torch.float64)
    a, b, c, d = (nn.Parameter(t.clone()) for t in (f32, f64, f32, f32))
    big = nn.Parameter(torch.zeros(1 << 16))  # 256 KiB
    assert pool_small([[a], [big], [b], [c], [d]], 4 << 20) == [[a, c, d], [big], [b]]  # the first's dtype
    assert pool_small([[a], [big], [b]], 4 << 20) == [[a], [big], [b]]  # one tiny per dtype: kept
    assert pool_small([[a], [c]], 16 * 32) == [[a], [c]]  # 32 B is not under gather_bytes / 16 = 32 B
    many = [[nn.Parameter(torch.zeros(15 << 10))] for _ in range(6)]  # 60 KiB each: 4 fit in 256 KiB
    assert pool_small(many, 4 << 20) == [[p for r in many[:4] for p in r], many[4], many[5]]
