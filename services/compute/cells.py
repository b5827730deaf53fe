"""Ready-made cells: the pieces most models are assembled from, each a :class:`Cell` with a name.

A model is a list of cells run one after the other (see :mod:`services.compute.cell`); these
cover a decoder-only transformer and a plain MLP, so a user writes a model as::

    model = [TokenEmbedding("embed", vocab, width, max_seq),
             *(TransformerBlock(f"block{i}", width, heads) for i in range(blocks)),
             LMHead("head", width, vocab)]

Each cell's parameters are named ``"{cell name}.{parameter}"`` like any other cell's, so a
checkpoint of a model built from them loads into ``nn.Sequential(*model)``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F

from services.compute.cell import Cell

__all__ = ["MLP", "LMHead", "TokenEmbedding", "TransformerBlock"]


class _Embedding(nn.Module):
    def __init__(self, vocab: int, width: int, max_seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.randn(max_seq, width) * 0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.shape[1] > self.pos.shape[0]:
            raise ValueError(f"sequence of {ids.shape[1]} tokens is longer than max_seq={self.pos.shape[0]}")
        tokens: torch.Tensor = self.tok(ids)
        return tokens + self.pos[: ids.shape[1]]


class _Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape
        # (b, t, 3w) -> 3 x (b, heads, t, w / heads)
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, w))
        out: torch.Tensor = x + self.mlp(self.norm2(x))
        return out


class _Head(nn.Module):
    def __init__(self, width: int, vocab: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.out(self.norm(x))
        return logits


class TokenEmbedding(Cell):
    """Token ids ``(batch, seq)`` -> token plus learned position embeddings ``(batch, seq, width)``.

    Raises (when called): ValueError for a sequence longer than ``max_seq``.
    """

    def __init__(self, name: str, vocab: int, width: int, max_seq: int) -> None:
        _positive(vocab=vocab, width=width, max_seq=max_seq)
        super().__init__(name, _Embedding(vocab, width, max_seq))


class TransformerBlock(Cell):
    """A pre-norm transformer block with causal self-attention: ``(batch, seq, width)`` in and out.

    A position attends only to itself and earlier positions; ``width`` must divide by ``heads``.
    """

    def __init__(self, name: str, width: int, heads: int) -> None:
        _positive(width=width, heads=heads)
        if width % heads:
            raise ValueError(f"{name}: width {width} does not divide into {heads} heads")
        super().__init__(name, _Block(width, heads))


class LMHead(Cell):
    """``(batch, seq, width)`` -> logits over the vocabulary ``(batch, seq, vocab)`` (layer norm, linear)."""

    def __init__(self, name: str, width: int, vocab: int) -> None:
        _positive(width=width, vocab=vocab)
        super().__init__(name, _Head(width, vocab))


class MLP(Cell):
    """Linear layers of ``sizes`` with GELU between them: ``(..., sizes[0])`` -> ``(..., sizes[-1])``."""

    def __init__(self, name: str, sizes: Sequence[int]) -> None:
        if len(sizes) < 2:
            raise ValueError(f"{name}: an MLP needs at least an input and an output size, got {list(sizes)}")
        _positive(**{f"sizes[{i}]": s for i, s in enumerate(sizes)})
        layers: list[nn.Module] = []
        for i, (n_in, n_out) in enumerate(itertools.pairwise(sizes)):
            if i:
                layers.append(nn.GELU())
            layers.append(nn.Linear(n_in, n_out))
        super().__init__(name, nn.Sequential(*layers))


def _positive(**sizes: int) -> None:
    bad = {k: v for k, v in sizes.items() if v < 1}
    if bad:
        raise ValueError(f"sizes must be >= 1, got {bad}")
