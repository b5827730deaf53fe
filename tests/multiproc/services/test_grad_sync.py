"""The communication service: two data-parallel replicas match one process on the global batch."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from services.params.grad_sync import assign_buckets
from services.params.layout import ShardLayout
from tests.harness.procs import RankGroup
from tests.multiproc.services import dp_checks

STEPS = 5
SEED = 11


@pytest.fixture(scope="module", params=["zmq", "gloo"])
def pair(request: pytest.FixtureRequest) -> Iterator[RankGroup]:
    with RankGroup(world_size=2, backend=request.param) as group:
        yield group


def _params(blob: dict[str, bytes]) -> dict[str, torch.Tensor]:
    return {k: torch.frombuffer(bytearray(v), dtype=torch.float64) for k, v in blob.items()}


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("bucket_bytes", [25 << 20, 300])
def test_two_replicas_match_one_process(pair: RankGroup, optimizer: str, bucket_bytes: int) -> None:
    results = pair.run("tests.multiproc.services.dp_checks:train_replica", optimizer=optimizer, steps=STEPS,
                       seed=SEED, bucket_bytes=bucket_bytes)
    ref = dp_checks.reference(optimizer, STEPS, SEED)
    if bucket_bytes == 300:
        assert results[0]["buckets"] > 3, "small buckets should split the model"
    for r, result in enumerate(results):
        got = _params(result["params"])
        for name, expected in ref.items():
            diff = (got[name] - expected.reshape(-1)).abs().max().item()
            assert diff < 1e-10, f"rank {r} {name}: max abs diff {diff:.3g} ({optimizer}, {bucket_bytes} B)"
    # the reference really moved: the comparison is not between two untouched models
    start = dp_checks.make_model(SEED).state_dict()
    assert any((ref[k] - start[k]).abs().max() > 1e-3 for k in ref)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_accumulated_microbatches_in_bucket_views_match_one_process(pair: RankGroup, set_to_none: bool
                                                                    ) -> None:
    results = pair.run("tests.multiproc.services.dp_checks:train_replica", optimizer="sgd", steps=STEPS,
                       seed=SEED, bucket_bytes=300, microbatches=2, set_to_none=set_to_none)
    ref = dp_checks.reference("sgd", STEPS, SEED)
    for r, result in enumerate(results):
        assert result["views"], f"rank {r}: param.grad is not a view into its bucket"
        got = _params(result["params"])
        for name, expected in ref.items():
            diff = (got[name] - expected.reshape(-1)).abs().max().item()
            assert diff < 1e-10, f"rank {r} {name}: max abs diff {diff:.3g} (set_to_none={set_to_none})"


@pytest.mark.parametrize(("optimizer", "microbatches", "set_to_none"),
                         [("sgd", 1, True), ("adam", 1, True), ("sgd", 2, True), ("sgd", 2, False)])
def test_gradients_all_reduced_as_they_are_match_one_process(pair: RankGroup, optimizer: str,
                                                             microbatches: int, set_to_none: bool) -> None:
    """[Note: a large gradient all-reduced as it is], every parameter so (``direct_bytes=1``): averaged in its
    own ``.grad``, accumulated there over microbatches, zeroed in place or set to None between steps."""
    results = pair.run("tests.multiproc.services.dp_checks:train_replica", optimizer=optimizer, steps=STEPS,
                       seed=SEED, bucket_bytes=25 << 20, microbatches=microbatches, set_to_none=set_to_none,
                       direct_bytes=1)
    ref = dp_checks.reference(optimizer, STEPS, SEED)
    names = [n for n, p in dp_checks.make_model(SEED).named_parameters()]
    for r, result in enumerate(results):
        assert sorted(result["direct"]) == sorted(names), result["direct"]  # every parameter alone, as itself
        got = _params(result["params"])
        for name, expected in ref.items():
            diff = (got[name] - expected.reshape(-1)).abs().max().item()
            assert diff < 1e-10, f"rank {r} {name}: max abs diff {diff:.3g}"


@pytest.mark.parametrize("direct_bytes", [1 << 40, 1])
def test_reduce_scatter_shards_are_the_averaged_gradient(pair: RankGroup, direct_bytes: int) -> None:
    """Packed buckets; and (``direct_bytes=1``) every parameter whose rows split evenly in a bucket of its
    own, reduce-scattered from its gradient as it is ([Note: a large gradient reduce-scattered as it is])."""
    results = pair.run("tests.multiproc.services.dp_checks:reduce_scatter_grads", seed=SEED, bucket_bytes=400,
                       direct_bytes=direct_bytes)
    model = dp_checks.make_model(SEED)
    x, y = dp_checks.batch(0, SEED)
    nn.functional.mse_loss(model(x), y).backward()
    even = [n for n, p in model.named_parameters() if p.shape[0] % 2 == 0]
    for rank, result in enumerate(results):
        assert result["direct"] == ([] if direct_bytes > 1 else even[::-1]), result["direct"]
        assert result["left"] == []  # the full gradients were dropped once packed
        assert set(result["shards"]) == {n for n, _ in model.named_parameters()}
        for name, p in model.named_parameters():
            assert p.grad is not None
            shape, data = result["shards"][name]
            expected = ShardLayout([p.shape], 2).shard_of(p.grad, 0, rank)
            shard = torch.frombuffer(bytearray(data), dtype=torch.float64).view(shape)
            assert shard.shape == expected.shape
            assert (shard - expected).abs().max().item() < 1e-12 if shard.numel() else True


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_ramped_bucket_set_matches_one_process(pair: RankGroup, stage: int, optimizer: str) -> None:
    """A small first bucket ([Note: the first bucket is small]) under plain data parallelism, ZeRO-1 and
    ZeRO-2, SGD with momentum and AdamW, on parameters whose rows do not split evenly over 2 ranks."""
    results = pair.run("tests.multiproc.services.dp_checks:train_sharded", stage=stage, optimizer=optimizer,
                       steps=STEPS, seed=SEED, bucket_bytes=300, first_bytes=200)
    # 1,016 B of parameters: the first bucket stops at 200 B (without the ramp it would take 232 B)
    assert results[0]["buckets"] == [["4.bias", "4.weight"], ["2.bias"], ["2.weight"], ["0.bias"],
                                     ["0.weight"]]
    ref = dp_checks.reference(optimizer, STEPS, SEED, odd=True)
    for r, result in enumerate(results):
        assert result["buckets"] == results[0]["buckets"]
        got = _params(result["params"])
        for name, expected in ref.items():
            diff = (got[name] - expected.reshape(-1)).abs().max().item()
            assert diff < 1e-10, f"rank {r} {name}: max abs diff {diff:.3g} (ZeRO-{stage}, {optimizer})"
    start = dp_checks.make_model(SEED, odd=True).state_dict()
    assert any((ref[k] - start[k]).abs().max() > 1e-3 for k in ref)


def test_assign_buckets_reverse_order_and_capacity() -> None:
    f32, f64 = torch.float32, torch.float64
    sizes = [("a", 40, f32), ("b", 40, f32), ("c", 100, f32), ("d", 8, f64), ("e", 30, f32)]
    buckets = assign_buckets(sizes, 80)
    assert buckets == [[4], [2], [1, 0], [3]]
    assert assign_buckets(sizes, 80, alone={1}) == [[4], [1], [2], [0], [3]]  # b as it comes, c still open
    flat = sorted(i for b in buckets for i in b)
    assert flat == list(range(len(sizes)))
