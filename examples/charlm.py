"""A character-level transformer language model, as four ready-made cells: embedding, two blocks, head.

Run it with ``cellmesh run examples/charlm.py --workers 2`` (``make demo`` does). It
trains on ``charlm.txt`` beside this file, about 15 kB of plain English the repository
ships, so nothing is downloaded. Each sample is a window of ``seq`` characters and its
targets are the same window shifted by one character: the model learns to predict the
next character. The loss starts near ``ln(vocabulary size)`` (4.14; a uniform guess over
the corpus's 53 characters is 3.97), is below 2.3 by step 100 and near 1.6 at step 300,
about 25-35 s of training on two CPU workers (measured with ``cellmesh demo``).

This file is also the example of a job module for ``cellmesh run``: it exposes ``job()``,
returning a :class:`cellmesh.Job` whose model, data and loss are module-level
factories the workers import by name (``charlm:model``...). See ``docs/running.md``.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from cellmesh import Cell, Job, LMHead, TokenEmbedding, TransformerBlock

CORPUS = Path(__file__).with_name("charlm.txt")
SEQ = 64


def corpus() -> str:
    """The training text (ASCII)."""
    return CORPUS.read_text(encoding="ascii")


def vocabulary() -> str:
    """The characters of the corpus, sorted: token ``i`` is ``vocabulary()[i]``."""
    return "".join(sorted(set(corpus())))


def encode(text: str) -> torch.Tensor:
    """``text`` as token ids (every character must be in the vocabulary)."""
    index = {ch: i for i, ch in enumerate(vocabulary())}
    return torch.tensor([index[ch] for ch in text], dtype=torch.long)


def decode(ids: torch.Tensor) -> str:
    chars = vocabulary()
    return "".join(chars[int(i)] for i in ids)


def model(width: int = 128, heads: int = 4, blocks: int = 2, seq: int = SEQ) -> list[Cell]:
    """The model factory: embedding, ``blocks`` transformer blocks, head, each a cell."""
    vocab = len(vocabulary())
    return [TokenEmbedding("embed", vocab, width, seq),
            *(TransformerBlock(f"block{i}", width, heads) for i in range(blocks)),
            LMHead("head", width, vocab)]


def data(seq: int = SEQ, stride: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """The data factory: every window of ``seq`` characters starting at a multiple of ``stride``.

    Returns:
        ``(inputs, targets)``, both ``(num_windows, seq)`` token ids; ``targets`` is
        ``inputs`` shifted one character ahead.
    """
    ids = encode(corpus())
    starts = torch.arange(0, len(ids) - seq - 1, stride)
    window = starts[:, None] + torch.arange(seq + 1)
    chunks = ids[window]
    return chunks[:, :-1].contiguous(), chunks[:, 1:].contiguous()


class NextCharLoss(nn.Module):
    """Mean cross-entropy of the logits ``(batch, seq, vocab)`` against the next characters."""

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def loss() -> nn.Module:
    """The loss factory."""
    return NextCharLoss()


def job() -> Job:
    """The job ``cellmesh run`` trains (its flags change any field: ``--workers 1``, ``--steps 50``)."""
    return Job(model=model, data=data, loss=loss, optimizer="AdamW",
               optimizer_kwargs={"lr": 3e-3, "weight_decay": 0.01}, global_batch=32, seed=0,
               name="charlm", steps=300, workers=2)


@torch.no_grad()
def generate(net: nn.Module, prompt: str, length: int, *, temperature: float = 0.8, seed: int = 0,
             seq: int = SEQ) -> str:
    """``prompt`` continued by ``length`` sampled characters (``net`` is ``nn.Sequential(*model())``)."""
    g = torch.Generator().manual_seed(seed)
    ids = encode(prompt)
    for _ in range(length):
        logits = net(ids[-seq:][None])[0, -1] / max(temperature, 1e-6)
        ids = torch.cat([ids, torch.multinomial(F.softmax(logits, -1), 1, generator=g)])
    return decode(ids)


def uniform_loss() -> float:
    """The loss of a uniform guess, ``ln(vocabulary size)``: where training starts."""
    return math.log(len(vocabulary()))
