"""A GPT-style language model on bytes of English, built from cellmesh's ready-made cells in a few lines.

Run it with ``cellmesh run examples/gpt.py --steps 20`` (two local workers). The model
reads raw bytes (a vocabulary of 256, nothing to download or tokenize) of ``charlm.txt``
beside this file; each sample is a window of ``seq`` bytes and its targets are the same
window shifted by one byte. It is GPT-2's layout, small: a token embedding with learned
positions, ``blocks`` pre-norm transformer blocks with causal attention, a final norm and
the head (``tie=True`` ties the head to the embedding's table, as GPT-2 does).

Measured with ``cellmesh run examples/gpt.py --steps 20`` on two CPU workers (0.50 M
parameters; the planner chose data parallel 2): the loss is 5.66 at step 1 (a uniform guess
over the 256 bytes is ln 256 = 5.55), 2.72 at step 10 and 2.46 at step 20, in 1.8 s of
training. ``--plan.num-stages 2`` (a 1F1B pipeline of 2 stages x 4 microbatches, cut after
``block1``) prints the same losses, in 3.6 s.

This is a job module for ``cellmesh run`` like ``examples/charlm.py``: ``job()`` returns the
:class:`cellmesh.Job`, whose model, data and loss are the module-level factories below,
which the workers import by name. Every factory keyword is a ``--set`` away:
``--set model.kwargs.dtype=float64``, ``--set model.kwargs.blocks=2``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from cellmesh import Cell, Job, LMHead, TokenEmbedding, TransformerBlock

CORPUS = Path(__file__).with_name("charlm.txt")
VOCAB = 256  # bytes
SEQ = 64
DTYPES = {"float32": torch.float32, "float64": torch.float64}


def model(width: int = 96, heads: int = 4, blocks: int = 4, seq: int = SEQ, mlp_ratio: float = 4.0,
          dropout: float = 0.0, tie: bool = False, dtype: str = "float32") -> list[Cell]:
    """The model factory: embedding, ``blocks`` transformer blocks, head; each a cell, in ``dtype``.

    ``tie=True`` makes the head's output weight the embedding's token table. Keep it off when
    a plan cuts the model into pipeline stages before the runtime keeps tied copies on two stages
    equal; on one stage (data parallel) it trains as one process does.
    """
    embed = TokenEmbedding("embed", VOCAB, width, seq, dropout=dropout)
    cells = [embed,
             *(TransformerBlock(f"block{i}", width, heads, mlp_ratio=mlp_ratio, dropout=dropout)
               for i in range(blocks)),
             LMHead("head", width, VOCAB, tie_to=embed if tie else None, bias=not tie)]
    return [cell.to(DTYPES[dtype]) for cell in cells]


def data(seq: int = SEQ, stride: int = 16,
         num_samples: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The data factory: windows of ``seq`` bytes of the corpus, one every ``stride`` bytes.

    Returns:
        ``(inputs, targets)``, both ``(num_windows, seq)`` byte values (int64); ``targets`` is
        ``inputs`` shifted one byte ahead. ``num_samples`` keeps the first that many windows.
    """
    ids = torch.tensor(list(CORPUS.read_bytes()), dtype=torch.long)
    starts = torch.arange(0, len(ids) - seq - 1, stride)[:num_samples]
    chunks = ids[starts[:, None] + torch.arange(seq + 1)]
    return chunks[:, :-1].contiguous(), chunks[:, 1:].contiguous()


class NextTokenLoss(nn.Module):
    """Mean cross-entropy of the logits ``(batch, seq, vocab)`` against the next tokens ``(batch, seq)``."""

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def loss() -> nn.Module:
    """The loss factory."""
    return NextTokenLoss()


def job() -> Job:
    """The job ``cellmesh run`` trains (its flags change any field: ``--steps 20``, ``--workers 1``)."""
    return Job(model=model, data=data, loss=loss, optimizer="AdamW",
               optimizer_kwargs={"lr": 3e-3, "weight_decay": 0.01}, global_batch=32, seed=0,
               name="gpt", steps=200, workers=2)
