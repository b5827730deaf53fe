"""CPU offload of the optimizer (``plan.offload``): step time with and without it, 2 workers, side by side.

The model is ``bench/zero.py``'s MLP (``bench.models:mlp``, 8 x Linear(1024, 1024) + GELU, 8.4 M
parameters, float32, global batch 64) with AdamW, data parallel over 2 local CPU workers, one torch
thread each, under ``plan.zero`` 0, 2 and 3, each with and without ``plan.offload``. A round runs every
configuration once on a fresh harness (``bench/zero.py``'s ``run_cellmesh``: warm-up, then timed steps),
each offloaded one right after its peer, the pairs' order swapped every round; the tables give the
median over rounds and the spread (min-max), the ratio taken within a round.

On CPU workers offload saves no memory (the host is the device): what it costs is the master copy (the
replica's rows of the parameters once more: ``StepReply.held_bytes`` shows it) and, per step, copying
the updated rows back (the gradients are read where they are). On a GPU the same path copies the
gradients down and the parameters up over PCIe and steps on the host's cores: not measured here.

    python bench/offload.py [--steps 10] [--warmup 3] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
from typing import Any

import torch

if not __package__:  # run as `python bench/x.py`: keep bench/comm.py from shadowing the comm package
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from bench.zero import MIB, MODELS, OPTIMIZERS, SEED, WORLD, run_cellmesh

ZEROS = (0, 2, 3)


def make_job(zero: int, offload: bool) -> Any:
    """``bench/zero.py``'s MLP with AdamW, data parallel 2, ``plan.zero`` and ``plan.offload`` fixed."""
    from coordinator.planning.resources import Resources
    from coordinator.runtime.job import Job

    spec, (cls, kwargs) = MODELS["mlp"], OPTIMIZERS["adamw"]
    return Job(model=spec.model, data=spec.data, loss=spec.loss, optimizer=cls, optimizer_kwargs=dict(kwargs),
               global_batch=spec.global_batch, seed=SEED, resources=Resources.local(WORLD),
               step_timeout_s=120, data_parallel=WORLD, num_stages=1, num_microbatches=1, zero=zero,
               offload=offload)


def cell(values: list[float], fmt: str = ".0f") -> str:
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from comm.logs import configure_logging

    configure_logging(terminal=True)
    load = [os.getloadavg()[0]]
    runs: dict[tuple[int, bool], list[dict[str, Any]]] = {}
    for r in range(args.rounds):
        for zero in ZEROS:
            for offload in ((False, True) if r % 2 == 0 else (True, False)):
                out = run_cellmesh(make_job(zero, offload), args.steps, args.warmup)
                runs.setdefault((zero, offload), []).append(out)
                print(f"round {r} zero {zero} offload {offload}: {out['step_s'] * 1e3:.0f} ms/step",
                      file=sys.stderr, flush=True)
        load.append(os.getloadavg()[0])
    rows = [f"`python bench/offload.py --rounds {args.rounds} --steps {args.steps} --warmup {args.warmup}`; "
            f"{platform.machine()}, torch {torch.__version__}, {os.cpu_count()} cores, 1-minute load "
            f"{min(load):.1f}-{max(load):.1f} (other work shared the cores).", "",
            "| plan | offload | ms per step | offload / not | optimizer phase, ms | held per replica, MiB |",
            "|---|---|---|---|---|---|"]
    for zero in ZEROS:
        for offload in (False, True):
            res = runs[zero, offload]
            steps = [o["step_s"] * 1e3 for o in res]
            ratio = ""
            if offload:
                ratio = cell([a["step_s"] / b["step_s"] for a, b in zip(res, runs[zero, False], strict=True)],
                             ".2f")
            opt = [statistics.median(p.optimizer for p in o["phases"]) * 1e3 for o in res]
            held = " / ".join(f"{h / MIB:.1f}" for h in res[-1]["held"])
            plan = f"ZeRO-{zero}" if zero else "data parallel"
            rows.append(f"| {plan} | {'yes' if offload else 'no'} | {cell(steps)} | {ratio} | "
                        f"{cell(opt, '.1f')} | {held} |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
