"""ZeRO-1/2's gather buckets: in forward order, the first ones small ([Note: the first buckets ramp up])."""

from __future__ import annotations

from torch import fx, nn

from services.params.commit_gather import RAMP_FLOOR, CommitGather, ramp
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
