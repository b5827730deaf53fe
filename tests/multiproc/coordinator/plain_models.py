"""Factories of models written as users write them, without cells: cellmesh traces and cuts them.

Both are float64 and tiny (a few thousand parameters), without dropout or BatchNorm, so a plan
and one process compute the same function:

* :func:`gpt`: a GPT-style decoder: token embedding plus learned positions, ``BLOCKS`` pre-norm
  blocks with residuals in an ``nn.ModuleList`` (each a node), a final norm and an untied head;
* :func:`resnet`: a ResNet-style network: a conv stem, basic blocks whose identity or projection
  shortcut is added in the model's own forward (each branch and each shortcut a node), and two
  heads, one of them on the stem's features: that long skip and the block's input cross every cut
  after the stem together with the main path (``structure="values"``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

VOCAB, SEQ, WIDTH, HEADS, BLOCKS = 32, 8, 16, 2, 4
CHANNELS, SIZE, CLASSES = 4, 8, 10
NUM_SAMPLES = 64


class Block(nn.Module):
    """Pre-norm: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``, causal."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, HEADS, batch_first=True)
        self.ln2 = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))
        self.register_buffer("causal", torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=self.causal, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.randn(SEQ, WIDTH) * 0.1)  # learned positions
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.ln = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def gpt() -> nn.Module:
    """Nodes: tok (with the positions), blocks.0-3, ln, head."""
    return GPT().double()


def tokens(num_samples: int = NUM_SAMPLES) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (num_samples, SEQ + 1))
    return ids[:, :-1], ids[:, 1:]


def _next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def lm_loss() -> object:
    return _next_token_loss


class Branch(nn.Module):
    """A basic block's residual branch: conv, norm, relu, conv, norm (GroupNorm: no batch statistics)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.norm1 = nn.GroupNorm(2, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.norm2 = nn.GroupNorm(2, cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm2(self.conv2(torch.relu(self.norm1(self.conv1(x)))))


class ResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        c = CHANNELS
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.blocks = nn.ModuleList([Branch(c, c, 1), Branch(c, 2 * c, 2), Branch(2 * c, 2 * c, 1)])
        self.shortcuts = nn.ModuleList([nn.Identity(), nn.Conv2d(c, 2 * c, 1, stride=2, bias=False),
                                        nn.Identity()])
        self.head = nn.Linear(2 * c, CLASSES)
        self.stem_head = nn.Linear(c, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = torch.relu(self.stem(x))
        h = s
        for block, shortcut in zip(self.blocks, self.shortcuts, strict=True):
            h = torch.relu(block(h) + shortcut(h))
        return self.head(h.mean(dim=(2, 3))) + self.stem_head(s.mean(dim=(2, 3)))


def resnet() -> nn.Module:
    """Nodes: stem, blocks.0, shortcuts.0, blocks.1, shortcuts.1, blocks.2, shortcuts.2, head, stem_head."""
    return ResNet().double()


def images(num_samples: int = NUM_SAMPLES) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randn(num_samples, 3, SIZE, SIZE, dtype=torch.float64),
            torch.randint(0, CLASSES, (num_samples,)))


def cross_entropy() -> nn.Module:
    return nn.CrossEntropyLoss()


class RoundStraightThrough(torch.autograd.Function):
    """Rounds to quarters in the forward; the backward passes the gradient straight through (the
    derivative of rounding is zero almost everywhere, so a graph of its operations trains nothing
    before it)."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad


class ScaleGradient(torch.autograd.Function):
    """The identity forward; the backward scales the gradient by ``scale`` (no gradient for ``scale``)."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale  # type: ignore[attr-defined]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None  # type: ignore[attr-defined]


class Quantized(nn.Module):
    """Linears with custom autograd functions between them, called in the model's own forward: a
    straight-through rounding and a gradient scaled by 0.5."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(WIDTH, WIDTH)
        self.second = nn.Linear(WIDTH, WIDTH)
        self.out = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = RoundStraightThrough.apply(torch.tanh(self.first(x)))
        h = ScaleGradient.apply(torch.tanh(self.second(h)), 0.5)
        return self.out(h)


def quantized() -> nn.Module:
    """Nodes: first (and the rounding), second (and the scaled gradient), out."""
    return Quantized().double()


def vectors(num_samples: int = NUM_SAMPLES) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randn(num_samples, WIDTH, dtype=torch.float64),
            torch.randint(0, CLASSES, (num_samples,)))


class InPlace(nn.Module):
    """A ResNet-style stem and block whose operations change their inputs in place: a top-level
    ``nn.ReLU(inplace=True)`` (its own node, so a cut may fall right before it) and ``h += skip``."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(WIDTH, WIDTH)
        self.relu = nn.ReLU(inplace=True)
        self.body = nn.Linear(WIDTH, WIDTH)
        self.out = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = self.relu(self.stem(x))
        h = self.body(skip)
        h += skip
        return self.out(h)


def in_place() -> nn.Module:
    """Nodes: stem, relu, body (and the in-place add), out."""
    return InPlace().double()


class Masked(nn.Module):
    """A forward of several arguments, as a model with an attention mask has: the mask is used after
    the first layers (so it crosses a cut), ``scale`` has a default."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(WIDTH, WIDTH)
        self.second = nn.Linear(WIDTH, WIDTH)
        self.out = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
        h = self.second(torch.tanh(self.first(x)))
        return self.out(torch.tanh(h) * mask * scale)


def masked() -> nn.Module:
    """Nodes: first, second, out (the mask joins the last)."""
    return Masked().double()


def masked_vectors(as_dict: bool = False, num_samples: int = NUM_SAMPLES) -> tuple[object, torch.Tensor]:
    """Inputs for ``masked``: ``(x, mask)``, or ``{"x": ..., "mask": ...}`` with ``as_dict``."""
    x = torch.randn(num_samples, WIDTH, dtype=torch.float64)
    mask = (torch.rand(num_samples, WIDTH) > 0.3).double()
    return ({"x": x, "mask": mask} if as_dict else (x, mask)), torch.randint(0, CLASSES, (num_samples,))
