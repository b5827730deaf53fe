"""A GPT-style model whose token embedding and output head share one Parameter (tied weights).

Its data and loss are ``tests.multiproc.coordinator.models``' ``tokens`` and ``token_loss``
(same vocabulary and sequence length). Cut into stages, the first and the last stage both hold
the tied matrix: the case ``services/params/tied.py`` exists for. No dropout, no randomness in
forward, so a plan and one process compute the same function.
"""

from __future__ import annotations

import torch
from torch import nn

from services.compute.cell import Cell
from tests.multiproc.coordinator.models import Embed, Head

WIDTH = 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.mix(x))


def tied_gpt(dtype: str = "float64") -> list[nn.Module]:
    """Cells ``embed``, ``block0``, ``block1``, ``head``; ``head.out.weight`` IS ``embed.tok.weight``."""
    embed, head = Embed(WIDTH), Head(WIDTH)
    head.out.weight = embed.tok.weight  # as GPT-2 ties wte and lm_head
    cells = [Cell("embed", embed), Cell("block0", Block()), Cell("block1", Block()), Cell("head", head)]
    nn.Sequential(*cells).to({"float64": torch.float64, "float32": torch.float32}[dtype])
    return cells
