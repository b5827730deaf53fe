"""A stage's backward, its weight gradients per microbatch or batched (``services/compute/weight_grads.py``).

One process, one torch thread, the stage ``bench/train.py``'s pipelines run: half of
``bench.models:mlp`` (4 x Linear(1024, 1024) + GELU), float32, ``m`` microbatches of
``64 / m`` rows, malloc tuned as in the workers (``comm/allocator.py``). After the ``m``
forwards, each variant runs the stage's backwards:

* ``B``: plain autograd, one backward per microbatch (the weight products per microbatch);
* ``I+W``: the split of zb-h1's steady state: each microbatch's ``I``, then its ``W`` alone
  (added in place into ``.grad``);
* ``I..I W``: every ``I``, then ONE ``W`` over all microbatches (one product per layer, through
  autograd as the step's last contribution):
  what GPipe (or 1F1B) would do if ``B`` deferred its weight gradients to the step's end;
* ``B in place``: what a 1F1B stage's ``B`` s run (``services/compute/executor.py``,
  ``weight_grads.in_place_backwards``): the first (no ``.grad`` yet) and the last ``B`` plain,
  each one in between ``I`` and at once its ``W``, added in place;
* ``B in place, all``: the same with the first and the last ``B`` split too (the first's ``W`` and
  the last's through autograd: the step's final flush), to show what leaving them plain saves.

The variants alternate within each repetition (noise hits them alike); the table shows the
median per variant and its ratio to ``B``, taken per repetition; and the bytes the batched
``W`` holds (each layer's input and output gradient of every microbatch).

    python bench/weight_grads.py [--reps 15] [--microbatches 8]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import torch
from torch import nn

if not __package__:  # run as `python bench/x.py`: keep bench/comm.py from shadowing the comm package
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from comm.allocator import tune_malloc
from services.compute.weight_grads import WeightGradStore, in_place_backwards
from services.protocol import Action

WIDTH, LAYERS, BATCH = 1024, 4, 64


def stage() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(LAYERS) for m in (nn.Linear(WIDTH, WIDTH), nn.GELU())])


def run(variant: str, net: nn.Module, store: WeightGradStore, xs: list[torch.Tensor]) -> float:
    """The backwards of one step (forwards untimed), in seconds."""
    net.zero_grad(set_to_none=True)
    m = len(xs)
    one_f_one_b = [Action.parse(f"0{kind}{i}") for i in range(m) for kind in "FB"]  # (its B's order)
    in_place = (set(range(m)) if variant == "B in place, all"
                else in_place_backwards(one_f_one_b, zero_grad=True) if variant == "B in place" else set())
    with store.deferring() if variant != "B" else contextlib.nullcontext():
        outs = []
        for i, x in enumerate(xs):
            store.microbatch = i if variant in ("I+W", "I..I W") or i in in_place else None
            outs.append(net(x))
        grads = [torch.ones_like(o) for o in outs]
        start = time.perf_counter()
        for i, (o, g) in enumerate(zip(outs, grads, strict=True)):
            o.backward(g)
            if variant == "I+W":
                store.flush([i])
            elif i in in_place:
                store.flush([i], final=i == m - 1, check=False)
        if variant == "I..I W":
            store.flush(None, final=True)
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--microbatches", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tune_malloc()  # as the workers do: freed weight-sized buffers are reused, not faulted in again
    m = args.microbatches
    net = stage()
    store = WeightGradStore(net)
    xs = [torch.randn(BATCH // m, WIDTH, requires_grad=True) for _ in range(m)]
    variants = ["B", "I+W", "I..I W", "B in place", "B in place, all"]
    times: dict[str, list[float]] = {v: [] for v in variants}
    ratios: dict[str, list[float]] = {v: [] for v in variants}
    for rep in range(args.reps + 2):
        order = variants if rep % 2 == 0 else variants[::-1]
        got = {v: run(v, net, store, xs) for v in order}
        if rep < 2:
            continue  # warm-up
        for v in variants:
            times[v].append(got[v])
            ratios[v].append(got[v] / got["B"])
    held = LAYERS * BATCH * (WIDTH + WIDTH) * 4
    print(f"stage: {LAYERS} x Linear({WIDTH}, {WIDTH}) + GELU, float32, {m} microbatches of "
          f"{BATCH // m} rows, 1 thread, {args.reps} repetitions")
    print(f"{'variant':<16} {'backwards ms':>13} {'vs B':>6} {'(min-max)':>13}")
    for v in variants:
        print(f"{v:<16} {statistics.median(times[v]) * 1e3:>13.2f} {statistics.median(ratios[v]):>6.3f} "
              f"({min(ratios[v]):.3f}-{max(ratios[v]):.3f})")
    print(f"the batched W holds {held / 2**20:.1f} MiB (inputs and output gradients of every layer and "
          "microbatch) until it runs")


if __name__ == "__main__":
    main()
