"""What keyed random draws cost (services/compute/randomness/): a dropout-heavy step with and without them.

One process, one thread. The model: 4 residual blocks, each Linear(w, w) + GELU + ``F.dropout``
+ ``nn.Dropout`` (8 dropout draws per forward), batch 32, float32, for a narrow (w=64) and a
wide (w=1024) width. Per width, the median over rounds (min-max) of one training step
(forward, backward) in ms:

* torch: dropout from torch's generator (what a plain PyTorch loop does);
* keyed: the forward inside ``ModelRandomness.forward`` (every op through the dispatch mode,
  the draws from the counter-based hash);
* no random op (``p=0``): the model plain; inside ``ModelRandomness.forward`` (the mode is
  dropped after the first forward found nothing to draw); and with the mode kept on (what every
  op pays for going through it).

The configurations are interleaved round by round, so load that drifts hits them alike.

    python bench/randomness.py [--rounds 5] [--steps 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

if not __package__:  # run as `python bench/x.py`: keep bench/comm.py from shadowing the comm package
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from torch import nn

BATCH, BLOCKS = 32, 4


class Block(nn.Module):
    def __init__(self, width: int, p: float) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.drop = nn.Dropout(p)
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(F.dropout(F.gelu(self.fc(x)), self.p, self.training)) + x


def _model(width: int, p: float) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(width, p) for _ in range(BLOCKS)])


def _step_fn(model: nn.Module, x: torch.Tensor, keyed: bool, *, force: bool = False) -> Callable[[int], None]:
    from services.compute.randomness import ModelRandomness

    randomness = ModelRandomness(model, seed=0)
    if force:
        randomness.keyed = True  # keep the mode on though nothing is drawn
    samples = list(range(BATCH))

    def step(k: int) -> None:
        model.zero_grad(set_to_none=True)
        if keyed:
            with randomness.forward(k, samples):
                out = model(x)
        else:
            out = model(x)
        out.square().mean().backward()  # type: ignore[no-untyped-call]

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from comm.allocator import tune_malloc

    tune_malloc()
    configs: dict[str, Callable[[int], None]] = {}
    for width in (64, 1024):
        x = torch.randn(BATCH, width)
        dropping, plain = _model(width, 0.1), _model(width, 0.0)
        configs[f"w={width} dropout: torch"] = _step_fn(dropping, x, keyed=False)
        configs[f"w={width} dropout: keyed"] = _step_fn(dropping, x, keyed=True)
        configs[f"w={width} no random op: plain"] = _step_fn(plain, x, keyed=False)
        configs[f"w={width} no random op: keyed (mode dropped)"] = _step_fn(plain, x, keyed=True)
        configs[f"w={width} no random op: keyed (mode kept)"] = _step_fn(plain, x, keyed=True, force=True)
    times: dict[str, list[float]] = {name: [] for name in configs}
    for step in configs.values():  # warm up (the first keyed forward also decides whether to key)
        for k in range(3):
            step(k)
    for _ in range(args.rounds):
        for name, step in configs.items():
            start = time.perf_counter()
            for k in range(args.steps):
                step(k)
            times[name].append((time.perf_counter() - start) / args.steps * 1e3)
    print(f"# keyed randomness, {BLOCKS} blocks x (Linear + GELU + 2 dropouts), batch {BATCH}, float32, "
          "1 thread")
    print(f"{args.rounds} rounds x {args.steps} steps; ms per training step, median (min-max) over rounds\n")
    print("| model | draws | ms/step |")
    print("|---|---|---|")
    for name, values in times.items():
        model, how = name.split(": ")
        print(f"| {model} | {how} | {statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f}) |")


if __name__ == "__main__":
    main()
