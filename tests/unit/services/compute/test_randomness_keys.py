"""The counter-based hash: exact 32-bit arithmetic, determinism, uniformity, per-sample independence."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from services.compute.randomness.keys import DrawKey, mix32, sample_hashes, uniform

KEY = DrawKey(seed=5, step=3, module="blocks.0.drop", counter=0)


def _lowbias32(x: int) -> int:
    """lowbias32 with Python's unbounded ints and the unsigned constants: the reference."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) % (1 << 32)
    x ^= x >> 15
    x = (x * 0x846CA68B) % (1 << 32)
    return x ^ (x >> 16)


def _draw(rows: list[int], shape: tuple[int, ...], key: DrawKey = KEY, *,
          double: bool = True) -> torch.Tensor:
    return uniform(key, (len(rows), *shape), sample_hashes(torch.tensor(rows)), double=double)


def test_mix32_is_lowbias32_computed_exactly_in_int64() -> None:
    values = [0, 1, 2, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 0x12345678, 0xDEADBEEF]
    values += torch.randint(0, 1 << 32, (2000,), generator=torch.Generator().manual_seed(0)).tolist()
    tensor = mix32(torch.tensor(values, dtype=torch.int64))
    assert tensor.tolist() == [_lowbias32(v) for v in values]
    assert [mix32(v) for v in values[:50]] == [_lowbias32(v) for v in values[:50]]
    assert int(tensor.min()) >= 0 and int(tensor.max()) < 1 << 32
    assert len(set(tensor.tolist())) == len(set(values))  # a bijection: no two inputs meet


def test_a_draw_is_a_function_of_its_key_rows_and_elements_only() -> None:
    a = _draw(list(range(8)), (3, 5))
    assert torch.equal(a, _draw(list(range(8)), (3, 5)))
    for change in ({"seed": 6}, {"step": 4}, {"module": "blocks.1.drop"}, {"counter": 1}, {"stream": 1},
                   {"batched": False}):
        other = _draw(list(range(8)), (3, 5), dataclasses.replace(KEY, **change))  # type: ignore[arg-type]
        assert (other != a).float().mean() > 0.99, change


def test_rows_drawn_together_or_apart_or_reordered_are_the_same() -> None:
    whole = _draw(list(range(8)), (4, 6))
    halves = torch.cat([_draw([0, 1, 2, 3], (4, 6)), _draw([4, 5, 6, 7], (4, 6))])
    assert torch.equal(whole, halves)
    order = [5, 2, 7, 0]
    assert torch.equal(_draw(order, (4, 6)), whole[order])
    assert torch.equal(_draw([3], (4, 6), double=False)[0], _draw(list(range(8)), (4, 6), double=False)[3])


def test_rows_of_one_sample_may_be_blocks_of_dim_0() -> None:
    """A [n * k, ...] draw with n sample hashes: each sample owns k consecutive rows of dim 0."""
    rows = sample_hashes(torch.tensor([10, 11, 12]))
    blocks = uniform(KEY, (6, 4), rows, double=True)
    assert torch.equal(blocks.reshape(3, 8), uniform(KEY, (3, 8), rows, double=True))
    with pytest.raises(ValueError, match=r"does not split into 3 rows"):
        uniform(KEY, (4, 4), rows, double=True)


def test_without_samples_the_tensor_is_one_row() -> None:
    once = uniform(dataclasses.replace(KEY, batched=False), (3, 4), None, double=True)
    assert torch.equal(once, uniform(dataclasses.replace(KEY, batched=False), (3, 4), None, double=True))
    assert once.shape == (3, 4) and len(set(once.flatten().tolist())) == 12


@pytest.mark.parametrize("double", [True, False])
def test_values_are_uniform_in_the_unit_interval(double: bool) -> None:
    u = _draw(list(range(64)), (20_000,), double=double)
    assert u.dtype == (torch.float64 if double else torch.float32)
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    n = u.numel()
    assert abs(float(u.mean()) - 0.5) < 4 * (1 / 12 / n) ** 0.5
    assert abs(float(u.double().var()) - 1 / 12) < 1e-3
    bins = torch.histc(u.double(), 20, 0, 1) / n
    assert float((bins - 0.05).abs().max()) < 0.002  # ~8 sigma of a bin count over 1.28M values
    corr = torch.corrcoef(u[:16].double()) - torch.eye(16, dtype=torch.float64)
    assert float(corr.abs().max()) < 0.04  # rows (samples) uncorrelated: 1/sqrt(20000) = 0.007


def test_float64_values_use_53_bits_and_float32_24() -> None:
    d = _draw(list(range(4)), (5000,)).flatten()
    scaled = d * 2.0 ** 53
    assert torch.equal(scaled, scaled.floor()) and bool((scaled % 2 == 1).any())
    f = _draw(list(range(4)), (5000,), double=False).flatten().double() * 2.0 ** 24
    assert torch.equal(f, f.floor()) and bool((f % 2 == 1).any())


def test_two_draws_of_one_sample_are_uncorrelated() -> None:
    a = _draw([7], (50_000,)).flatten()
    b = _draw([7], (50_000,), dataclasses.replace(KEY, counter=1)).flatten()
    assert abs(float(torch.corrcoef(torch.stack([a, b]))[0, 1])) < 0.02
