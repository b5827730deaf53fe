"""The command line every round-based training benchmark shares: steps, warm-up, rounds, a quick smoke run.

``bench/train.py``, ``bench/amp.py`` and ``bench/models.py`` time each configuration for
``--steps`` steps after ``--warmup`` untimed ones, in ``--rounds`` rounds; ``--quick`` is a
smoke run (1 round, 3 steps, 1 warm-up step). :func:`parse_rounds` also pins this process and
the workers it starts to one torch thread, as every figure in docs/benchmarks.md was taken.
"""

from __future__ import annotations

import argparse
import os

import torch

__all__ = ["parse_rounds", "round_parser"]


def round_parser(description: str | None, what: str) -> argparse.ArgumentParser:
    """A parser with the shared options; ``what`` names what is timed (``"configuration"``)."""
    parser = argparse.ArgumentParser(description=(description or "").split("\n")[0])
    parser.add_argument("--steps", type=int, default=10, help=f"timed steps per {what} and round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 round, 3 steps, 1 warm-up step")
    return parser


def parse_rounds(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """The parsed arguments (``--quick`` applied), with torch on one thread here and in the workers."""
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps, args.warmup = 1, 3, 1
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    return args
