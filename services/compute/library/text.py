"""Cells of a decoder-only (GPT-style) language model: embedding, transformer block, LM head.

A GPT is written as::

    embed = TokenEmbedding("embed", vocab, width, max_seq)
    model = [embed,
             *(TransformerBlock(f"block{i}", width, heads) for i in range(blocks)),
             LMHead("head", width, vocab, tie_to=embed)]

Shapes: token ids ``(batch, seq)`` -> ``(batch, seq, width)`` through every block -> logits
``(batch, seq, vocab)``. The block is pre-norm (GPT-2's layout): ``x + attn(norm1(x))``, then
``x + mlp(norm2(x))``, attention through ``F.scaled_dot_product_attention``.

Weight tying: ``LMHead(..., tie_to=embed)`` makes the head's output weight *the same*
``nn.Parameter`` as the embedding's token table (``vocab x width``), as GPT-2 does. On one
process, or on any plan whose one stage holds both cells, that is all tying takes; keeping
the copies of a tied parameter equal when the two cells run on different pipeline stages is
the runtime's job (it finds the shared tensor under both names of the model's state_dict).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn
from torch.nn import functional as F

from services.compute.cell import Cell
from services.compute.library.checks import label, positive, probability, require
from services.compute.library.common import Perceptron, activation_layer, norm_layer

__all__ = ["LMHead", "TokenEmbedding", "TransformerBlock"]


class _Embedding(nn.Module):
    def __init__(self, vocab: int, width: int, max_seq: int, dropout: float) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.randn(max_seq, width) * 0.02)
        self.drop = nn.Dropout(dropout)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.shape[1] > self.pos.shape[0]:
            raise ValueError(f"sequence of {ids.shape[1]} tokens is longer than max_seq={self.pos.shape[0]}")
        out: torch.Tensor = self.drop(self.tok(ids) + self.pos[: ids.shape[1]])
        return out


class _Block(nn.Module):
    def __init__(self, width: int, heads: int, hidden: int, act: nn.Module, norm: str, eps: float,
                 dropout: float, causal: bool, bias: bool, cell: str) -> None:
        super().__init__()
        self.heads = heads
        self.causal = causal
        self.attn_dropout = dropout
        self.norm1 = norm_layer(cell, norm, width, eps)
        self.qkv = nn.Linear(width, 3 * width, bias=bias)
        self.proj = nn.Linear(width, width, bias=bias)
        self.norm2 = norm_layer(cell, norm, width, eps)
        self.mlp = Perceptron([width, hidden, width], act, bias=bias)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape
        # (b, t, 3w) -> 3 x (b, heads, t, w / heads): q, k, v each split into heads
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal,
                                              dropout_p=self.attn_dropout if self.training else 0.0)
        x = x + self.drop(self.proj(attn.transpose(1, 2).reshape(b, t, w)))
        out: torch.Tensor = x + self.drop(self.mlp(self.norm2(x)))
        return out


class _Head(nn.Module):
    def __init__(self, width: int, vocab: int, norm: str, eps: float, bias: bool, cell: str) -> None:
        super().__init__()
        self.norm = norm_layer(cell, norm, width, eps)
        self.out = nn.Linear(width, vocab, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.out(self.norm(x))
        return logits


class TokenEmbedding(Cell):
    """Token ids ``(batch, seq)`` -> token plus learned position embeddings ``(batch, seq, width)``.

    Args:
        name: The cell's name.
        vocab: The number of token ids (ids are ``0 .. vocab - 1``).
        width: The embedding size.
        max_seq: The longest sequence it embeds (the rows of the position table).
        dropout: Dropout on the sum (training only).

    Parameters: ``{name}.pos`` (``max_seq x width``, normal with std 0.02) and
    ``{name}.tok.weight`` (``vocab x width``, :attr:`token_weight`).

    Raises:
        ValueError: A size below 1 or a dropout outside ``[0, 1)``; when called, a sequence
            longer than ``max_seq``.
    """

    def __init__(self, name: str, vocab: int, width: int, max_seq: int, *, dropout: float = 0.0) -> None:
        cell = label("TokenEmbedding", name)
        positive(cell, vocab=vocab, width=width, max_seq=max_seq)
        probability(cell, dropout=dropout)
        super().__init__(name, _Embedding(vocab, width, max_seq, dropout))

    @property
    def token_weight(self) -> nn.Parameter:
        """The token table ``(vocab, width)``: what :class:`LMHead` ties its output weight to."""
        table = cast(_Embedding, self.module).tok.weight
        assert isinstance(table, nn.Parameter)  # nn.Embedding's weight; the stub says Tensor
        return table


class TransformerBlock(Cell):
    """A pre-norm transformer block: ``(batch, seq, width)`` in and out.

    ``x + drop(proj(attention(norm1(x))))``, then ``x + drop(mlp(norm2(x)))``; the MLP is
    Linear(width, hidden), activation, Linear(hidden, width) with ``hidden = int(mlp_ratio * width)``.

    Args:
        name: The cell's name.
        width: The model width; must divide by ``heads``.
        heads: The attention heads (each ``width // heads`` wide).
        mlp_ratio: The MLP's hidden size as a multiple of ``width`` (4 in GPT-2).
        dropout: On the attention weights and on both residual branches (training only).
        causal: A position attends only to itself and earlier ones (a decoder); ``False``
            attends everywhere (an encoder).
        norm: ``"layernorm"`` or ``"rmsnorm"``; ``eps`` its epsilon.
        activation: The MLP's activation (``"gelu"``, ``"relu"``, ``"silu"``, ``"tanh"``).
        bias: Whether the linear layers have biases.

    Parameters: ``{name}.norm1.*``, ``{name}.qkv.*`` (``3 * width x width``: queries, keys,
    values), ``{name}.proj.*``, ``{name}.norm2.*``, ``{name}.mlp.layers.{0,1}.*``.

    Raises:
        ValueError: A size below 1, ``heads`` not dividing ``width``, ``mlp_ratio`` giving a
            hidden size below 1, a dropout outside ``[0, 1)``, an unknown norm or activation.
    """

    def __init__(self, name: str, width: int, heads: int, *, mlp_ratio: float = 4.0, dropout: float = 0.0,
                 causal: bool = True, norm: str = "layernorm", eps: float = 1e-5, activation: str = "gelu",
                 bias: bool = True) -> None:
        cell = label("TransformerBlock", name)
        positive(cell, width=width, heads=heads)
        require(width % heads == 0, cell, f"heads={heads} does not divide width={width}: choose a width that "
                f"is a multiple of the heads")
        require(isinstance(mlp_ratio, int | float) and int(mlp_ratio * width) >= 1, cell,
                f"mlp_ratio must be a number giving an MLP hidden size int(mlp_ratio * width) of at least 1, "
                f"got mlp_ratio={mlp_ratio!r} with width={width}")
        probability(cell, dropout=dropout)
        act = activation_layer(cell, activation)
        super().__init__(name, _Block(width, heads, int(mlp_ratio * width), act, norm, eps, dropout, causal,
                                      bias, cell))


class LMHead(Cell):
    """``(batch, seq, width)`` -> logits ``(batch, seq, vocab)``: a norm, then a linear map.

    Args:
        name: The cell's name.
        width: The model width.
        vocab: The vocabulary size.
        norm: The final norm, ``"layernorm"`` or ``"rmsnorm"``; ``eps`` its epsilon.
        bias: Whether the output layer has a bias.
        tie_to: A :class:`TokenEmbedding` of the same ``vocab`` and ``width`` whose token table
            becomes this head's output weight (one shared ``nn.Parameter``; see the module docstring).

    Parameters: ``{name}.norm.*``, ``{name}.out.weight`` (``vocab x width``; the embedding's
    table when tied) and ``{name}.out.bias``.

    Raises:
        ValueError: A size below 1, an unknown norm, or a ``tie_to`` that is not a
            TokenEmbedding of this vocab and width.
    """

    def __init__(self, name: str, width: int, vocab: int, *, norm: str = "layernorm", eps: float = 1e-5,
                 bias: bool = True, tie_to: TokenEmbedding | None = None) -> None:
        cell = label("LMHead", name)
        positive(cell, width=width, vocab=vocab)
        head = _Head(width, vocab, norm, eps, bias, cell)
        if tie_to is not None:
            require(isinstance(tie_to, TokenEmbedding), cell,
                    f"tie_to must be a TokenEmbedding cell, got {type(tie_to).__name__}")
            table = tie_to.token_weight
            require(tuple(table.shape) == (vocab, width), cell,
                    f"tie_to={tie_to.name!r} has a {table.shape[0]} x {table.shape[1]} token table, the head "
                    f"maps width {width} to vocab {vocab}: give both the same vocab and width")
            head.out.weight = table
        super().__init__(name, head)
