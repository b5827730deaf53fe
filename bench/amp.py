"""Mixed precision's throughput: cellmesh training the demo's transformer in fp32 and in bf16, side by side.

The model of ``examples/charlm.py`` (``cellmesh run examples/charlm.py``, ``make demo``):
embedding, 2 transformer blocks, head, width 128 by default (``--width``), sequences of 64
characters, global batch 32, AdamW, one torch thread per worker. Four configurations on one
``LocalHarness`` of two workers, every one from the same initial parameters on the same
batches:

* data parallel 2 (one stage), fp32 and bf16 (``plan.precision``);
* 2 stages, 1F1B, 4 microbatches, fp32 and bf16;

and, for the compute alone, one process timing the model's forward and backward on one
replica's share (16 samples) in fp32 and under bf16 autocast, one thread, no cellmesh.
Every round runs every configuration once (the order rotated round by round, so load that
drifts hits them alike), ``--steps`` timed steps after ``--warmup``; the tables show the
median (min-max) over rounds, and the bf16/fp32 ratio is taken within each round. The CPU's
bf16 instructions (``avx512_bf16``, ``amx_bf16``) are printed: without them bf16 matmuls are
emulated through float32 and autocast only adds casts.

    python bench/amp.py [--steps 10] [--warmup 3] [--rounds 3] [--width 128] [--quick]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

if not __package__:  # run as `python bench/x.py`: keep bench/comm.py from shadowing the comm package
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch

from bench.rounds import parse_rounds, round_parser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
WORKERS = 2
GLOBAL_BATCH = 32
PLANS: dict[str, dict[str, Any]] = {
    "dp2": dict(data_parallel=2, num_stages=1, num_microbatches=1),
    "1f1b2x4": dict(data_parallel=1, num_stages=2, num_microbatches=4, schedule="1f1b"),
}
LABELS = {"dp2": "data parallel 2", "1f1b2x4": "2 stages, 1F1B x 4 microbatches"}
PRECISIONS = ("fp32", "bf16")


def make_job(plan: str, precision: str, width: int) -> Any:
    from coordinator.planning.resources import Resources
    from coordinator.runtime.job import Job

    return Job(model="charlm:model", model_kwargs={"width": width}, data="charlm:data", loss="charlm:loss",
               optimizer="AdamW", optimizer_kwargs={"lr": 3e-3, "weight_decay": 0.01},
               global_batch=GLOBAL_BATCH, seed=0, name=f"amp-{plan}-{precision}", code_dir=EXAMPLES,
               resources=Resources.local(WORKERS), step_timeout_s=300, precision=precision, **PLANS[plan])


def run_cellmesh(job: Any, harness: Any, steps: int, warmup: int) -> dict[str, Any]:
    """samples/s over ``steps`` steps after ``warmup``, the last loss, and each stage's median action times.

    A step's request commits the previous step, so the first step after the warm-up is left out
    of the timing (each timed step then carries one commit).
    """
    with job.attach(harness):
        job.fit(max(0, warmup - 1))
        result = job.fit(steps + 1)
    recs = result.steps[1:]
    wall = recs[-1].end - recs[0].start
    stages = job.plan().num_stages
    actions = {(kind, s): statistics.median(e.end - e.start for r in recs for e in r.events
                                            if e.replica == 0 and e.stage == s and e.action is not None
                                            and e.action.kind == kind)
               for kind in "FB" for s in range(stages)}
    return {"samples_s": GLOBAL_BATCH * steps / wall, "loss": recs[-1].loss, "actions": actions}


def compute_only(width: int, precision: str, repeats: int) -> float:
    """Median seconds of one forward and backward of the model on 16 samples, one thread, no cellmesh."""
    import charlm

    from coordinator.runtime.factories import build_model, unwrapped

    net, loss_fn = unwrapped(build_model("charlm:model", {"width": width}, 0)), charlm.loss()
    x, y = charlm.data()
    x, y = x[:GLOBAL_BATCH // WORKERS], y[:GLOBAL_BATCH // WORKERS]
    times = []
    for _ in range(repeats + 2):
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = loss_fn(net(x), y)
        loss.backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def _cpu() -> tuple[str, list[str]]:
    """The CPU's model name and which bf16 instruction sets it has."""
    name, flags = platform.processor() or "unknown CPU", set()
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return name, sorted(flags & {"avx512_bf16", "amx_bf16", "amx_tile", "avx512f"})


def _cell(values: list[float], fmt: str = ".1f", unit: str = "") -> str:
    """Median (min-max); one value if they all print alike."""
    if not values:
        return "-"
    low, mid, high = (format(v, fmt) for v in (min(values), statistics.median(values), max(values)))
    return f"{mid}{unit}" if low == high else f"{mid}{unit} ({low}-{high})"


def report(rounds: list[dict[str, dict[str, Any]]], compute: list[dict[str, float]], args: argparse.Namespace,
           elapsed: float, load: tuple[float, float]) -> str:
    cpu, flags = _cpu()
    out = [f"# mixed precision: cellmesh in fp32 and bf16, {WORKERS} workers on loopback", "",
           f"date {dt.date.today()}, {platform.node()}, {os.cpu_count()} cores ({cpu}; bf16 instructions: "
           f"{', '.join(flags) or 'none'}), torch {torch.__version__}",
           f"examples/charlm.py model, width {args.width}, global batch {GLOBAL_BATCH}, AdamW, 1 thread per "
           f"worker; {len(rounds)} rounds x {args.steps} timed steps after {args.warmup} warm-up steps (run "
           f"took {elapsed:.0f} s); median (min-max) over rounds",
           f"1-minute load average {load[0]:.1f} at the start, {load[1]:.1f} at the end", "",
           "| configuration | fp32 samples/s | bf16 samples/s | bf16 / fp32 "
           "| loss after last step fp32 / bf16 |",
           "|---|---|---|---|---|"]
    for plan in PLANS:
        rate = {p: [r[f"{plan}-{p}"]["samples_s"] for r in rounds] for p in PRECISIONS}
        loss = {p: _cell([r[f"{plan}-{p}"]["loss"] for r in rounds], ".4f") for p in PRECISIONS}
        ratio = [b / f for f, b in zip(rate["fp32"], rate["bf16"], strict=True)]
        out.append(f"| {LABELS[plan]} | {_cell(rate['fp32'])} | {_cell(rate['bf16'])} "
                   f"| {_cell(ratio, '.2f', 'x')} | {loss['fp32']} / {loss['bf16']} |")
    fp32, bf16 = ([c[p] * 1e3 for c in compute] for p in PRECISIONS)
    out.append(f"| one process, forward + backward of 16 samples (compute only) | {_cell(fp32)} ms | "
               f"{_cell(bf16)} ms | {_cell([f / b for f, b in zip(fp32, bf16, strict=True)], '.2f', 'x')} "
               "faster | |")
    out += ["", "Median action times on replica 0 (ms): forward and backward per stage, fp32 -> bf16.", "",
            "| configuration | stage | forward | backward |", "|---|---|---|---|"]
    for plan in PLANS:
        stages = PLANS[plan]["num_stages"]
        for s in range(stages):
            cells = []
            for kind in "FB":
                f, b = ([r[f"{plan}-{p}"]["actions"][(kind, s)] * 1e3 for r in rounds] for p in PRECISIONS)
                cells.append(f"{_cell(f)} -> {_cell(b)}")
            out.append(f"| {LABELS[plan]} | {s} | {cells[0]} | {cells[1]} |")
    return "\n".join(out)


def main() -> None:
    parser = round_parser(__doc__, "configuration")
    parser.add_argument("--width", type=int, default=128, help="the model's width (charlm's: 128)")
    args = parse_rounds(parser)
    sys.path.insert(0, EXAMPLES)
    from coordinator.runtime.factories import job_factories
    from coordinator.runtime.harness import LocalHarness

    started, load = time.monotonic(), os.getloadavg()[0]
    jobs = {f"{plan}-{p}": make_job(plan, p, args.width) for plan in PLANS for p in PRECISIONS}
    for key, job in jobs.items():
        print(f"[plan] {key}: {job.plan().summary()}", file=sys.stderr)
    factories = sorted({name for job in jobs.values() for name in job_factories(job.config)})
    rounds: list[dict[str, dict[str, Any]]] = []
    compute: list[dict[str, float]] = []
    names = [f"local-{i}" for i in range(WORKERS)]
    with LocalHarness(names, job="bench-amp", threads=1, python_path=[ROOT, EXAMPLES],
                      lease_ttl=timedelta(seconds=5), factories=factories) as harness:
        keys = list(jobs)
        for i in range(args.rounds):
            measured: dict[str, dict[str, Any]] = {}
            for key in keys[i % len(keys):] + keys[:i % len(keys)]:
                t0 = time.monotonic()
                measured[key] = run_cellmesh(jobs[key], harness, args.steps, args.warmup)
                print(f"[round {i + 1}/{args.rounds}] {key}: {measured[key]['samples_s']:.1f} samples/s "
                      f"({time.monotonic() - t0:.1f} s)", file=sys.stderr)
            rounds.append(measured)
            compute.append({p: compute_only(args.width, p, args.steps) for p in PRECISIONS})
    print(report(rounds, compute, args, time.monotonic() - started, (load, os.getloadavg()[0])))


if __name__ == "__main__":
    main()
