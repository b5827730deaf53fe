"""Factories the coordinator tests name: models as cell sequences, their data and losses.

Every factory takes ``dtype`` ("float64" for the exact parity tests, "float32" for the
tolerance ones). Models have no dropout and no randomness in forward, so a plan and one
process compute the same function.
"""

from __future__ import annotations

import torch
from torch import nn

from services.compute.cell import Cell

IN, HIDDEN, OUT = 6, 12, 3
NUM_SAMPLES = 64
WIDE = 256
VOCAB, SEQ, WIDTH = 11, 8, 16


def _dt(dtype: str) -> torch.dtype:
    return {"float64": torch.float64, "float32": torch.float32}[dtype]


def mlp(dtype: str = "float64") -> list[nn.Module]:
    """Six plain modules (cells ``cell0``..``cell5``); one tensor crosses any cut."""
    return [m.to(_dt(dtype)) for m in (nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(),
                                       nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, OUT))]


def deep_mlp(dtype: str = "float64") -> list[nn.Module]:
    """Eight cells (an input layer, six tanh blocks, a head): enough for 4 workers x 2 chunks."""
    blocks = [nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh()) for _ in range(6)]
    return [m.to(_dt(dtype)) for m in (nn.Linear(IN, HIDDEN), *blocks, nn.Linear(HIDDEN, OUT))]


def wide_mlp(dtype: str = "float64") -> list[nn.Module]:
    """Four cells of 256 features: a microbatch's rows are a small share of a layer's weights, so a 1F1B stage
    holds its in-between W's and computes them in one flush ([Note: a backward's weight gradients in
    place] in services/compute/weight_grads.py)."""
    return [m.to(_dt(dtype)) for m in (nn.Linear(IN, WIDE), nn.Sequential(nn.Linear(WIDE, WIDE), nn.Tanh()),
                                       nn.Sequential(nn.Linear(WIDE, WIDE), nn.Tanh()), nn.Linear(WIDE, OUT))]


class Stem(nn.Module):
    """x -> (h, skip): the skip connection starts here and crosses the next cuts."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(IN, HIDDEN)
        self.b = nn.Linear(IN, HIDDEN)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tanh(self.a(x)), self.b(x)


class Mix(nn.Module):
    """(h, skip) -> {"h", "skip"}: the skip is relayed untouched."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, hs: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        h, skip = hs
        return {"h": torch.tanh(self.c(h)), "skip": skip}


class Merge(nn.Module):
    """The skip connection ends here: h + skip."""

    def __init__(self) -> None:
        super().__init__()
        self.d = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.tanh(self.d(x["h"]) + x["skip"])


def skip_model(dtype: str = "float64") -> list[nn.Module]:
    """Four cells; a tuple crosses cut 1, a dict cut 2: the skip crosses every cut before ``merge``."""
    return [Cell("stem", Stem().to(_dt(dtype))), Cell("mix", Mix().to(_dt(dtype))),
            Cell("merge", Merge().to(_dt(dtype))), Cell("head", nn.Linear(HIDDEN, OUT).to(_dt(dtype)))]


def regression(dtype: str = "float64", num_samples: int = NUM_SAMPLES) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(num_samples, IN, dtype=_dt(dtype)), torch.randn(num_samples, OUT, dtype=_dt(dtype))


def mse() -> nn.Module:
    return nn.MSELoss()


class Embed(nn.Module):
    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, width)
        self.pos = nn.Parameter(torch.randn(SEQ, width) * 0.1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tok(ids) + self.pos[: ids.shape[1]]


class Head(nn.Module):
    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def transformer(dtype: str = "float64") -> list[nn.Module]:
    """Embedding, two encoder blocks (no dropout), head: four cells."""
    blocks = [nn.TransformerEncoderLayer(WIDTH, nhead=2, dim_feedforward=2 * WIDTH, dropout=0.0,
                                         batch_first=True) for _ in range(2)]
    cells = [Cell("embed", Embed()), Cell("block0", blocks[0]), Cell("block1", blocks[1]),
             Cell("head", Head())]
    return [c.to(_dt(dtype)) for c in cells]


def tokens(num_samples: int = NUM_SAMPLES) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token sequences; the target is the next token (the sequence shifted by one)."""
    seq = torch.randint(0, VOCAB, (num_samples, SEQ + 1))
    return seq[:, :-1], seq[:, 1:]


class TokenLoss(nn.Module):
    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def token_loss() -> nn.Module:
    return TokenLoss()


class Sleep(nn.Module):
    """Identity that takes ``seconds`` per forward: makes a step last long enough to kill a worker in it."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import time

        time.sleep(self.seconds)
        return x


def slow_mlp(seconds: float = 0.2) -> list[nn.Module]:
    return [*mlp()[:3], Sleep(seconds), *mlp()[3:]]


def failing_data(bad_from: int = 40) -> object:
    """A loader over ``regression()``'s samples that raises for any index >= ``bad_from``."""
    x, y = regression()

    def load(indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        if max(indices) >= bad_from:
            raise ValueError(f"sample {max(indices)} is corrupt (injected)")
        index = torch.tensor(indices)
        return x[index], y[index]

    return load
