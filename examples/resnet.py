"""A small ResNet-style image classifier on synthetic images, built from cellmesh's ready-made cells.

Run it with ``cellmesh run examples/resnet.py --steps 20`` (two local workers). The data is
made up, so nothing is downloaded: each class is a fixed random pattern (a ``channels x size
x size`` image drawn once from the data seed) and each sample is its class's pattern under
heavy Gaussian noise (``noise`` times the pattern's scale), so the classes are learnable but
not at a glance. The model is a conv stem, then stages of basic residual blocks, each stage
after the first doubling the channels and halving the image (its first block projects the
skip connection), then global average pooling and a linear classifier. The norms are
GroupNorm (``norm="group"``): each sample is normalized on its own, so a pipeline's
microbatches compute what the whole batch computes.

Measured with ``cellmesh run examples/resnet.py --steps 20`` on two CPU workers (20 k
parameters; the planner chose data parallel 2): the loss is 1.40 at step 1 (a uniform guess
over 4 classes is ln 4 = 1.39), 1.32 at step 10 and 1.16 at step 20, in 2.0 s of training;
the default 100 steps end near 0.11 (5.1 s). ``--plan.num-stages 2`` prints the same losses.

This is a job module for ``cellmesh run`` like ``examples/gpt.py``; every factory keyword is
a ``--set`` away (``--set model.kwargs.depths=[1,1,1]``, ``--set data.kwargs.noise=1.0``).
"""

from __future__ import annotations

import torch
from torch import nn

from cellmesh import Cell, ClassifierHead, ConvBlock, Job, ResidualBlock

DTYPES = {"float32": torch.float32, "float64": torch.float64}
CHANNELS, SIZE, CLASSES = 3, 16, 4


def model(width: int = 16, depths: tuple[int, ...] | list[int] = (1, 1), classes: int = CLASSES,
          channels: int = CHANNELS, norm: str = "group", dtype: str = "float32") -> list[Cell]:
    """The model factory: a stem, then ``depths[i]`` residual blocks of ``width * 2**i`` channels
    for each stage ``i``, then the head; each a cell, in ``dtype``."""
    cells: list[Cell] = [ConvBlock("stem", channels, width, norm=norm)]
    have = width
    for stage, depth in enumerate(depths):
        want = width * 2**stage
        for i in range(depth):
            cells.append(ResidualBlock(f"s{stage}b{i}", have, want, stride=2 if stage and not i else 1,
                                       norm=norm))
            have = want
    cells.append(ClassifierHead("head", have, classes))
    return [cell.to(DTYPES[dtype]) for cell in cells]


def data(num_samples: int = 512, classes: int = CLASSES, channels: int = CHANNELS, size: int = SIZE,
         noise: float = 2.0, dtype: str = "float32") -> tuple[torch.Tensor, torch.Tensor]:
    """The data factory: ``num_samples`` noisy images of ``classes`` patterns, classes in turn.

    Returns:
        ``(images, labels)``: ``(num_samples, channels, size, size)`` in ``dtype`` and
        ``(num_samples,)`` class indices (int64).
    """
    patterns = torch.randn(classes, channels, size, size, dtype=DTYPES[dtype])
    labels = torch.arange(num_samples) % classes
    images = patterns[labels] + noise * torch.randn(num_samples, channels, size, size, dtype=DTYPES[dtype])
    return images, labels


def loss() -> nn.Module:
    """The loss factory: cross-entropy of the logits ``(batch, classes)`` against the labels."""
    return nn.CrossEntropyLoss()


def job() -> Job:
    """The job ``cellmesh run`` trains (its flags change any field: ``--steps 20``, ``--workers 1``)."""
    return Job(model=model, data=data, loss=loss, optimizer="AdamW", optimizer_kwargs={"lr": 3e-3},
               global_batch=32, seed=0, name="resnet", steps=100, workers=2)
