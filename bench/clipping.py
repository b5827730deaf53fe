"""What clipping by the global gradient norm costs per step, across pipeline stages and parameter shards.

The training benchmark's model and data (``bench/train.py``: 8 x Linear(1024, 1024) + GELU,
8.4 M parameters, global batch 64, float32, SGD, one torch thread per worker) on two local
workers, with two plans fixed up front from one profile each:

* 1F1B, 2 stages x 8 microbatches (the [4, 4] split): each stage reports its gradients'
  squared norm with its step reply (from the read that already checks them for NaN and
  Inf), the coordinator adds them and the coefficient rides on the commit that goes out
  with the next step; each stage multiplies its gradients by it before its optimizer step;
* data parallel 2 through parameter servers: each shard holds its round until the
  coordinator has every shard's norm and sends the coefficient (one more coordinator round
  trip per step, while the stages wait in their pull).

Every round trains each plan ``warmup + steps`` steps with ``clip_grad_norm`` unset and set
(0.002, about half these gradients' norm: every step clips), one after the other on one harness,
the order swapped round by round. The figures: the time per timed step (median over rounds,
with the spread), the ratio of the two within each round, the optimizer phase (the stages'
commit: scaling and the optimizer step) and the push/pull phase (parameter servers: pushes,
the held round, pulls), each per step and slowest stage or replica, and the coordinator's
own time per step (``StepRecord.coordinator_s``), and the final loss (the same in every round
for a plan and a setting; clipping changes it).

On a loaded machine the step times of two runs differ by more than clipping costs, so the
parts are also timed alone in this process, on one stage's gradients (half the model, 17 MB
of float32), one thread: the finiteness check as it was (a sum per gradient), the check that
also gives the squared norm (a norm per gradient, ``services/compute/executor.py``), and the
multiplication by the coefficient before the optimizer step (``torch._foreach_mul_``).

    python bench/clipping.py [--rounds 3] [--steps 30] [--warmup 5] [--quick]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

if not __package__:  # run as `python bench/x.py`: keep bench/comm.py from shadowing the comm package
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from bench.train import DATA, GLOBAL_BATCH, LOSS, LR, MICROBATCHES, MODEL, SEED, _cpu_model
from coordinator.planning.plan import Plan
from coordinator.runtime.factories import build_model, job_factories
from coordinator.runtime.harness import LocalHarness
from coordinator.runtime.job import Job
from coordinator.runtime.records import StepRecord
from services.compute.cell import as_cells, cell_parameters

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = ("local-0", "local-1")
MAX_NORM = 0.002  # these gradients' norm is 0.004-0.005: every step clips (by about half)
PLANS: dict[str, tuple[str, dict[str, Any]]] = {
    "1f1b": ("1F1B 2 stages x 8", dict(data_parallel=1, num_stages=2, num_microbatches=MICROBATCHES,
                                       schedule="1f1b", balance=[4, 4])),
    "ps": ("data parallel 2, parameter servers", dict(data_parallel=2, num_stages=1, num_microbatches=1,
                                                      mode="parameter_server")),
}
Round = dict[str, dict[str, float]]


def make_job(plan: Plan | None = None, **fields: Any) -> Job:
    """A job of the training benchmark's model, on ``plan`` (fixed) or the plan section ``fields`` give."""
    return Job(model=MODEL, loss=LOSS, data=DATA, optimizer="SGD", optimizer_kwargs={"lr": LR},
               global_batch=GLOBAL_BATCH, seed=SEED, step_timeout_s=120, code_dir=ROOT, plan=plan, **fields)


def _phase(recs: Sequence[StepRecord], name: str) -> float:
    """Seconds per step of phase ``name``, the slowest stage or replica's of each step."""
    return statistics.fmean(max((e.end - e.start for e in r.events if e.name == name), default=0.0)
                            for r in recs)


def run(plan: Plan, harness: LocalHarness, clip: float | None, args: argparse.Namespace) -> dict[str, float]:
    """Train ``warmup + steps`` steps with ``clip_grad_norm=clip``; time the last ``steps``."""
    job = make_job(plan, clip_grad_norm=clip)
    with job.attach(harness):
        result = job.fit(args.warmup + args.steps)
    recs = result.steps[args.warmup:]
    norms = [r.grad_norm for r in recs if r.grad_norm is not None]  # collective only
    return {"step_s": (recs[-1].end - recs[0].start) / len(recs), "optimizer_s": _phase(recs, "optimizer"),
            "push_pull_s": _phase(recs, "push_pull"),
            "coordinator_s": statistics.fmean(r.coordinator_s for r in recs), "loss": result.losses[-1],
            "grad_norm": statistics.median(norms) if norms else 0.0}


def micro(repeats: int = 50) -> dict[str, float]:
    """Seconds per call of the stage's parts of clipping, on one stage's gradients (see the docstring)."""
    from services.compute.executor import check_grads

    cells = as_cells(build_model(MODEL, {}, SEED))
    grads = [(n, torch.randn_like(p)) for n, p in cell_parameters(cells[:len(cells) // 2])]
    tensors = [g for _, g in grads]

    def sums() -> None:
        torch.stack([t.sum() for t in tensors]).isfinite().tolist()

    def scale() -> None:
        torch._foreach_mul_(tensors, 1.0 - 1e-7)

    out = {}
    for name, fn in (("sum_check", sums), ("norm_check", lambda: check_grads(grads)), ("scale", scale)):
        fn()
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        out[name] = (time.perf_counter() - t0) / repeats
    out["mbytes"] = sum(t.numel() * t.element_size() for t in tensors) / 1e6
    return out


def _cell(values: Sequence[float], scale: float = 1e3, fmt: str = ".1f") -> str:
    return (f"{statistics.median(values) * scale:{fmt}} ({min(values) * scale:{fmt}}-"
            f"{max(values) * scale:{fmt}})")


def _norm(rounds: Sequence[Round]) -> str:
    return f"{statistics.median(r['1f1b/on']['grad_norm'] for r in rounds):.4f}"


def report(rounds: Sequence[Round], parts: Sequence[dict[str, float]], args: argparse.Namespace,
           elapsed: float, load: tuple[float, float]) -> str:
    out = ["# clipping by the global norm: the training benchmark's model on 2 local workers", "",
           f"date {dt.date.today()}, {platform.node()}, {os.cpu_count()} cores ({_cpu_model()}), "
           f"torch {torch.__version__}, Python {platform.python_version()}",
           f"{len(rounds)} rounds x {args.steps} timed steps after {args.warmup} warm-up steps (run took "
           f"{elapsed:.0f} s); median (min-max) over rounds; clip_grad_norm {MAX_NORM}, the gradient "
           f"norm before clipping {_norm(rounds)} (1F1B, median step)",
           f"1-minute load average {load[0]:.1f} at the start, {load[1]:.1f} at the end (this run's own "
           "processes add up to 2)", "",
           "| plan | clipping | ms per step | on / off | optimizer ms | push/pull ms | coordinator ms | "
           "final loss |", "|---|---|---|---|---|---|---|---|"]
    for key, (label, _) in PLANS.items():
        for tag in ("off", "on"):
            runs = [r[f"{key}/{tag}"] for r in rounds]
            ratio = [r[f"{key}/on"]["step_s"] / r[f"{key}/off"]["step_s"] for r in rounds]
            out.append(f"| {label} | {tag} | {_cell([x['step_s'] for x in runs])} | "
                       f"{_cell(ratio, 1.0, '.3f') if tag == 'on' else ''} | "
                       f"{_cell([x['optimizer_s'] for x in runs], fmt='.2f')} | "
                       f"{_cell([x['push_pull_s'] for x in runs], fmt='.2f')} | "
                       f"{_cell([x['coordinator_s'] for x in runs], fmt='.2f')} | "
                       f"{statistics.median(x['loss'] for x in runs):.6f} |")
    cells = [_cell([p[k] for p in parts], fmt=".2f") for k in ("sum_check", "norm_check", "scale")]
    out += ["", f"one stage's gradients ({parts[0]['mbytes']:.0f} MB), timed alone, ms per call, median "
                "(min-max) over rounds:", "",
            "| finiteness check (sums, before) | finiteness check and squared norm (norms, now) | scale by "
            "the coefficient |", "|---|---|---|", f"| {' | '.join(cells)} |"]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps before them")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 round, 10 timed steps")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps = 1, 10
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    from comm.allocator import tune_malloc
    from comm.logs import configure_logging

    tune_malloc()
    configure_logging(terminal=True)
    started, load = time.monotonic(), os.getloadavg()[0]
    plans = {key: make_job(**fields).plan() for key, (_, fields) in PLANS.items()}  # one profile each
    rounds: list[Round] = []
    parts: list[dict[str, float]] = []
    with LocalHarness(WORKERS, job="bench-clipping", threads=1, python_path=[ROOT],
                      factories=job_factories(make_job().config)) as harness:
        for i in range(args.rounds):
            measured: Round = {}
            for key, plan in plans.items():
                for clip in (None, MAX_NORM)[::-1 if i % 2 else 1]:
                    tag = f"{key}/{'on' if clip else 'off'}"
                    t0 = time.monotonic()
                    measured[tag] = run(plan, harness, clip, args)
                    figures = ", ".join(f"{k} {v:.4f}" for k, v in measured[tag].items())
                    print(f"[round {i + 1}/{args.rounds}] {tag}: {figures} ({time.monotonic() - t0:.1f} s)",
                          file=sys.stderr)
            rounds.append(measured)
            parts.append(micro())
    print(report(rounds, parts, args, time.monotonic() - started, (load, os.getloadavg()[0])))


if __name__ == "__main__":
    main()
