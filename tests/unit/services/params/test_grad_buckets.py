"""The gradient buckets' assignment: a small first bucket per dtype, then the cap ([Note: the first bucket is
small] in services/params/grad_sync.py)."""

from __future__ import annotations

import torch

from services.params.grad_sync import FIRST_BUCKET_BYTES, assign_buckets

F32, F64 = torch.float32, torch.float64


def test_first_bucket_is_capped_then_the_rest_fill_to_bucket_bytes() -> None:
    sizes = [(f"p{i}", 30, F32) for i in range(8)]  # reverse order: p7 first
    assert assign_buckets(sizes, 100, first_bytes=60) == [[7, 6], [5, 4, 3], [2, 1, 0]]
    assert assign_buckets(sizes, 100) == [[7, 6, 5], [4, 3, 2], [1, 0]]  # no ramp: as before
    assert assign_buckets(sizes, 100, first_bytes=500) == [[7, 6, 5], [4, 3, 2], [1, 0]]  # capped by the cap


def test_a_parameter_larger_than_the_first_bucket_goes_alone_and_closes_it() -> None:
    sizes = [("a", 10, F32), ("b", 80, F32), ("c", 10, F32)]
    # c opens the first bucket (cap 20); b does not fit, so c's bucket closes and b starts the next (cap 100)
    assert assign_buckets(sizes, 100, first_bytes=20) == [[2], [1, 0]]
    # a first bucket's only parameter may exceed its cap: it is never left empty
    assert assign_buckets([("big", 500, F32)], 100, first_bytes=20) == [[0]]


def test_each_dtype_ramps_on_its_own_and_alone_parameters_do_not_count() -> None:
    sizes = [("a", 30, F64), ("b", 30, F64), ("c", 30, F32), ("d", 30, F64), ("e", 30, F32),
             ("f", 30, F32), ("g", 30, F32)]
    buckets = assign_buckets(sizes, 90, alone={5}, first_bytes=30)
    # g: the float32 first bucket (cap 30), closed by e, which opens the next (cap 90) with c; f alone;
    # d: the float64 first bucket, closed by b; a and b fill the next one
    assert buckets == [[5], [6], [3], [4, 2], [1, 0]]  # f alone comes as its gradient does, before g's
    assert sorted(i for b in buckets for i in b) == list(range(len(sizes)))


def test_the_assignment_depends_on_sizes_alone() -> None:
    """Every replica computes the same buckets from the same model: no state, no randomness."""
    sizes = [(f"p{i}", (i * 37) % 200 + 4, F32 if i % 3 else F64) for i in range(60)]
    first = assign_buckets(sizes, 500, alone={7, 20}, first_bytes=64)
    assert all(assign_buckets(sizes, 500, alone={7, 20}, first_bytes=64) == first for _ in range(3))
    for b in first:  # one dtype a bucket
        assert len({sizes[i][2] for i in b}) == 1


def test_the_gpt_of_the_benchmark_sends_its_last_megabyte_first() -> None:
    """The GPT of bench/zero.py (6.6 MB, one 25 MiB bucket before): now a first bucket of at most 1 MiB."""
    from examples.gpt import model

    cells = model(width=128, heads=4, blocks=8, seq=64)
    named = [(n, p) for c in cells for n, p in c.named_parameters()]
    sizes = [(n, p.numel() * p.element_size(), p.dtype) for n, p in named]
    buckets = assign_buckets(sizes, 25 << 20, first_bytes=FIRST_BUCKET_BYTES)
    assert len(buckets) == 2
    first = sum(sizes[i][1] for i in buckets[0])
    assert FIRST_BUCKET_BYTES - sizes[buckets[1][0]][1] < first <= FIRST_BUCKET_BYTES
    assert buckets[0][0] == len(sizes) - 1  # the head's bias: backward's first gradient
    assert sorted(i for b in buckets for i in b) == list(range(len(sizes)))
