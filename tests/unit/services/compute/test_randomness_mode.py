"""Keyed forwards: dropout and the other random ops draw per (seed, step, module, call, sample, element)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from services.compute.cell import as_cells
from services.compute.randomness import Drawn, ModelRandomness, check_draws, reproducible

SAMPLES = list(range(100, 108))


class Block(nn.Module):
    """nn.Dropout and F.dropout in one block: two draws of one module per call."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(F.dropout(torch.tanh(self.fc(x)), 0.2, self.training)) + x


class Probe(nn.Module):
    """Runs ``draw(x)`` and returns it: one random op at a time, inside a module."""

    def __init__(self, draw: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.draw = draw

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.draw(x)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block(), Block()).double()


def _x(n: int = 8) -> torch.Tensor:
    return torch.randn(n, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def _keyed(model: nn.Module, x: torch.Tensor, samples: list[int], step: int = 3,
           seed: int = 1) -> torch.Tensor:
    with reproducible(model, seed=seed, step=step, samples=samples):
        out: torch.Tensor = model(x)
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal up to the matmuls' rounding, which changes with the number of rows."""
    torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_dropout_of_a_batch_equals_dropout_of_any_split_of_it() -> None:
    model, x = _model(), _x()
    whole = _keyed(model, x, SAMPLES)
    _same(whole, torch.cat([_keyed(model, x[:4], SAMPLES[:4]), _keyed(model, x[4:], SAMPLES[4:])]))
    _same(whole, torch.cat([_keyed(model, x[i:i + 2], SAMPLES[i:i + 2]) for i in range(0, 8, 2)]))
    drops = nn.Sequential(nn.Dropout(0.5), Probe(lambda t: F.dropout(t, 0.3, True)))
    ones = torch.ones(8, 64, dtype=torch.float64)
    masks = _keyed(drops, ones, SAMPLES)
    assert torch.equal(masks, torch.cat([_keyed(drops, ones[i:i + 1], SAMPLES[i:i + 1]) for i in range(8)]))


def test_the_draws_depend_on_seed_step_and_samples() -> None:
    model, x = _model(), _x()
    whole = _keyed(model, x, SAMPLES)
    assert not torch.equal(whole, _keyed(model, x, SAMPLES, step=4))
    assert not torch.equal(whole, _keyed(model, x, SAMPLES, seed=2))
    assert not torch.equal(whole, _keyed(model, x, list(range(8))))
    _same(whole, _keyed(_model(), x, SAMPLES))  # another copy of the model: the same names


def test_a_forward_leaves_torchs_generator_alone() -> None:
    model, x = _model(), _x()
    before = torch.get_rng_state()
    _keyed(model, x, SAMPLES)
    assert torch.equal(before, torch.get_rng_state())


def test_dropout_drops_p_and_scales_the_rest() -> None:
    drop = Probe(lambda x: F.dropout(x, 0.3, True))
    x = torch.ones(64, 1000, dtype=torch.float64)
    out = _keyed(drop, x, list(range(64)))
    assert abs(float((out == 0).double().mean()) - 0.3) < 0.01
    assert torch.allclose(out[out != 0], torch.full_like(out[out != 0], 1 / 0.7))


def test_the_fused_kernel_drops_what_the_cpu_path_drops() -> None:
    """GPUs run aten.native_dropout; the CPU path is bernoulli_(1 - p): the same mask either way."""
    x = _x()
    cpu_path = _keyed(Probe(lambda t: F.dropout(t, 0.4, True)), x, SAMPLES)
    fused = _keyed(Probe(lambda t: torch.ops.aten.native_dropout(t, 0.4, True)[0]), x, SAMPLES)
    assert torch.equal(cpu_path, fused)


def test_a_module_called_twice_draws_twice() -> None:
    drop = nn.Dropout(0.5)
    twice = Probe(lambda t: torch.stack([drop(t), drop(t)]))
    twice.add_module("drop", drop)
    out = _keyed(twice, torch.ones(8, 64, dtype=torch.float64), SAMPLES)
    assert not torch.equal(out[0], out[1])


def test_attention_dropout_with_the_heads_flattened_into_dim_0_is_per_sample() -> None:
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(8, 2, dropout=0.5, batch_first=True).double()
    probe = Probe(lambda t: attention(t, t, t)[0])  # need_weights=True: weights [n * heads, L, S]
    probe.add_module("attention", attention)
    x = torch.randn(8, 5, 8, dtype=torch.float64)
    whole = _keyed(probe, x, SAMPLES)
    _same(whole, torch.cat([_keyed(probe, x[:4], SAMPLES[:4]), _keyed(probe, x[4:], SAMPLES[4:])]))


def test_a_draw_not_shaped_by_the_batch_is_the_same_in_every_forward() -> None:
    """``torch.rand(5)`` is keyed without samples: one process's value, whatever the microbatch.

    Unless a microbatch has 5 samples: its dim 0 is then the sample count, and it is drawn per sample.
    """
    noise = Probe(lambda t: t[:, :5] * 0 + torch.rand(5, dtype=t.dtype))
    x = _x()
    whole = _keyed(noise, x, SAMPLES)
    parts = [_keyed(noise, x[a:b], SAMPLES[a:b]) for a, b in ((0, 3), (3, 6), (6, 8))]
    assert torch.equal(whole[0], whole[7]) and torch.equal(whole, torch.cat(parts))
    five = _keyed(noise, x[:5], SAMPLES[:5])
    assert not torch.equal(five[0], whole[0])


OPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "rand_like": torch.rand_like,
    "randn_like": torch.randn_like,
    "rand": lambda t: torch.rand(t.shape, dtype=t.dtype),
    "randn": lambda t: torch.randn(*t.shape, dtype=t.dtype),
    "uniform_": lambda t: torch.empty_like(t).uniform_(-2, 3),
    "normal_": lambda t: torch.empty_like(t).normal_(1.0, 2.0),
    "bernoulli": lambda t: torch.bernoulli(torch.full_like(t, 0.25)),
    "bernoulli_p": lambda t: torch.empty_like(t).bernoulli_(0.25),
    "normal(mean, std)": lambda t: torch.normal(torch.zeros_like(t), 2.0),
    "randint": lambda t: torch.randint(3, 9, t.shape).to(t.dtype),
    "randint_like": lambda t: torch.randint_like(t, 5),
    "exponential_": lambda t: torch.empty_like(t).exponential_(2.0),
}
MOMENTS: dict[str, tuple[float, float]] = {  # mean and variance of each op's distribution
    "rand_like": (0.5, 1 / 12), "rand": (0.5, 1 / 12), "randn_like": (0.0, 1.0), "randn": (0.0, 1.0),
    "uniform_": (0.5, 25 / 12), "normal_": (1.0, 4.0), "bernoulli": (0.25, 0.1875),
    "bernoulli_p": (0.25, 0.1875),
    "normal(mean, std)": (0.0, 4.0), "randint": (5.5, 35 / 12), "randint_like": (2.0, 2.0),
    "exponential_": (0.5, 0.25),
}


@pytest.mark.parametrize("name", list(OPS))
def test_each_random_op_is_keyed_per_sample_with_its_distribution(name: str) -> None:
    probe = Probe(OPS[name])
    x = torch.zeros(64, 2000, dtype=torch.float64)
    out = _keyed(probe, x, list(range(64)))
    assert torch.equal(out[10:20], _keyed(probe, x[10:20], list(range(10, 20))))
    mean, var = MOMENTS[name]
    assert abs(float(out.mean()) - mean) < 0.02 * max(1.0, var ** 0.5), float(out.mean())
    assert abs(float(out.var()) - var) < 0.03 * var, float(out.var())
    if name.startswith("randint"):
        assert set(out.unique().tolist()) == ({3.0, 4.0, 5.0, 6.0, 7.0, 8.0} if name == "randint"
                                              else {0.0, 1.0, 2.0, 3.0, 4.0})


def test_an_op_without_a_keyed_implementation_runs_seeded_from_its_key() -> None:
    probe = Probe(lambda t: t[:, :1] * 0 + torch.randperm(t.shape[0]).to(t.dtype)[:, None])
    x = _x()
    before = torch.get_rng_state()
    first = _keyed(probe, x, SAMPLES)
    assert torch.equal(first, _keyed(probe, x, SAMPLES)) and torch.equal(before, torch.get_rng_state())
    assert sorted(first.flatten().tolist()) == list(range(8))


def test_a_model_that_draws_nothing_stops_being_keyed_after_its_first_forward() -> None:
    plain = ModelRandomness(nn.Sequential(nn.Linear(2, 2), nn.Tanh()), seed=0)
    assert plain.keyed is None
    with plain.forward(0, [0]):
        torch.zeros(1)
    assert plain.keyed is False
    functional = ModelRandomness(Probe(lambda t: F.dropout(t, 0.5, True)), seed=0)
    with functional.forward(0, [0]):
        functional_out = F.dropout(torch.ones(1, 8), 0.5, True)
    assert functional.keyed is True and functional_out.shape == (1, 8)
    assert ModelRandomness(_model(), seed=0).keyed is True  # nn.Dropout: keyed from the start


def test_attention_without_dropout_draws_nothing_and_with_dropout_is_keyed() -> None:
    """The CPU's fused attention op is tagged random whatever its dropout_p: at 0 it draws nothing, so a
    transformer without dropout runs its forwards without the keyed mode (every op through Python)."""
    q = torch.randn(2, 2, 5, 4, generator=torch.Generator().manual_seed(0))

    def attention(p: float) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda t: F.scaled_dot_product_attention(t, t, t, is_causal=True, dropout_p=p)

    probe = Probe(attention(0.0))
    plain = ModelRandomness(probe, seed=0)
    record: list[Drawn] = []
    with plain.forward(0, [0, 1], record=record):
        out = probe(q)
    assert plain.keyed is False and record == []
    torch.testing.assert_close(out, attention(0.0)(q), rtol=0, atol=0)
    probe = Probe(attention(0.5))
    dropped = ModelRandomness(probe, seed=0)
    with dropped.forward(0, [0, 1]):
        first = probe(q)
    with dropped.forward(0, [0, 1]):
        again = probe(q)
    assert dropped.keyed is True and torch.equal(first, again) and not torch.equal(first, out)


def test_a_stage_of_cells_draws_what_the_users_model_draws() -> None:
    """Cells wrap the model's modules (names '0.fc' -> cell 'cell0', 'fc'): the keys use the model's names."""
    made = [Block(), Block(), Block()]
    for m in made:
        m.double()
    x = _x()
    users = _keyed(nn.Sequential(*made), x, SAMPLES)
    cells = as_cells(made)
    first, second = nn.Sequential(*cells[:1]), nn.Sequential(*cells[1:])
    with ModelRandomness(first, 1).forward(3, SAMPLES[:5]):
        h = first(x[:5])
    with ModelRandomness(second, 1).forward(3, SAMPLES[:5]):
        out = second(h)
    _same(out, users[:5])


def _draws(model: nn.Module, x: torch.Tensor, n: int) -> list[Drawn]:
    record: list[Drawn] = []
    with ModelRandomness(model, 0).forward(0, list(range(n)), record):
        model(x)
    return record


def test_draws_whose_size_follows_the_batch_off_dim_0_are_named() -> None:
    seq_first = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.1)  # (sequence, batch, width)
    small, large = _draws(seq_first, torch.randn(5, 2, 8), 2), _draws(seq_first, torch.randn(5, 3, 8), 3)
    assert small[0] == Drawn("self_attn", 0, (2, 2, 5, 5), True)  # attention runs batch first inside
    problem = check_draws(small, large, (2, 3))
    assert problem is not None
    assert problem.startswith("module 'dropout1' draws random tensors of shape [5, 2, 8] for 2 samples and "
                              "[5, 3, 8] for 3: its size follows")
    assert "put the batch first (batch_first=True)" in problem
    first = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.1, batch_first=True)
    assert check_draws(_draws(first, torch.randn(2, 5, 8), 2), _draws(first, torch.randn(3, 5, 8), 3),
                       (2, 3)) is None
    noise = Probe(lambda t: t + torch.rand(4, dtype=t.dtype))  # one shape at every batch size: the same draw
    small, large = _draws(noise, torch.zeros(2, 4), 2), _draws(noise, torch.zeros(3, 4), 3)
    assert check_draws(small, large, (2, 3)) is None


def test_an_evaluation_forward_does_not_decide_that_a_model_draws_nothing() -> None:
    model = Probe(lambda t: F.dropout(t, 0.5, model.training))
    randomness = ModelRandomness(model, seed=0)
    model.train(False)
    with randomness.forward(0, [0]):
        model(torch.ones(1, 8))
    assert randomness.keyed is None
    model.train()
    with randomness.forward(0, [0]):
        model(torch.ones(1, 8))
    assert randomness.keyed is True


def test_a_dropout_of_zero_is_not_a_random_layer() -> None:
    assert ModelRandomness(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.0)), seed=0).keyed is None
    assert ModelRandomness(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.1)), seed=0).keyed is True
