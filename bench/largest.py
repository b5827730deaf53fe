"""The largest MLP that trains 2 steps on 2 workers capped at 4 GiB each, per way of saving memory.

The model: ``Linear(64, w)``, ``DEPTH`` blocks ``Linear(w, w), Tanh``, ``Linear(w, 8)``, float32,
Adam, global batch 16 (8 samples a replica), one stage on 2 data-parallel workers, each started with
``--memory-limit`` 4 GiB (``comm/memcap.py``). Per configuration (replicated, ZeRO-1, ZeRO-2, ZeRO-3,
ZeRO-3 with recompute, and replicated and ZeRO-3 with offload: on a CPU worker the host is the device,
so offload's master copy costs memory there instead of saving it), the width ``w`` is bracketed (by
x1.4 from a guess) and then bisected to a multiple of ``STEP``: a trial trains 2 steps on a fresh
harness and counts as fitting if both steps end. The planner is given the plan's fields fixed and
resources it cannot fill, so that it never refuses: its predicted per-worker peak is reported against
the cap, for the largest width that trained and the one after.

The process itself keeps ~2 GiB per trial of 200 M parameters (not found why): run one
configuration at a time.

    python bench/largest.py [--cap-gib 4] [--configs replicated,zero3] [--tolerance 0.03] [--json FILE]

``--width W`` trains each configuration once at width ``W`` instead of searching, and prints the
planner's prediction against the workers' peak (``measured / predicted``): the check of the memory
model at the sizes the search found.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = str(Path(__file__).resolve().parents[1])
if __name__ == "__main__":  # run as a script: the repository, not bench/ (bench/comm.py), first on the path
    sys.path[0] = ROOT

IN, OUT, SAMPLES = 64, 8, 64
DEPTH = 4
STEP = 128  # widths are multiples of this
GROWTH = 1.4  # the bracket grows by this factor (the width's square is what the state grows with)
NAMES = ["local-0", "local-1"]
CONFIGS: dict[str, dict[str, Any]] = {
    "replicated": {},
    "zero1": {"zero": 1, "shard_factor": 2},
    "zero2": {"zero": 2, "shard_factor": 2},
    "zero3": {"zero": 3, "shard_factor": 2},
    "zero3+recompute": {"zero": 3, "shard_factor": 2, "recompute": True},
    "replicated+offload": {"offload": True},
    "zero3+offload": {"zero": 3, "shard_factor": 2, "offload": True},
}


def mlp(width: int = 1024, depth: int = DEPTH) -> list[nn.Module]:
    """The benchmark's model: ``depth + 2`` cells."""
    blocks = [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)]
    return [nn.Linear(IN, width), *blocks, nn.Linear(width, OUT)]


def data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(SAMPLES, IN, generator=gen), torch.randn(SAMPLES, OUT, generator=gen)


def mse() -> nn.Module:
    return nn.MSELoss()


def params_of(width: int, depth: int = DEPTH) -> int:
    return IN * width + width + depth * (width * width + width) + width * OUT + OUT


@dataclass
class Trial:
    width: int
    params: int
    trained: bool
    predicted_bytes: int
    measured_peak_bytes: int  # the largest StepReply.peak_bytes (0 if no step ended)
    seconds: float
    error: str


def make_job(width: int, fields: dict[str, Any]) -> Any:
    from coordinator.planning.resources import Resources
    from coordinator.runtime.job import Job

    return Job(model="bench.largest:mlp", model_kwargs={"width": width}, loss="bench.largest:mse",
               data="bench.largest:data", optimizer="Adam", optimizer_kwargs={"lr": 1e-4}, global_batch=16,
               seed=1, resources=Resources.local(2, memory_bytes=1 << 40), step_timeout_s=900,
               data_parallel=2, num_stages=1, num_microbatches=1, code_dir=ROOT, memory_cap=False, **fields)


def trial(width: int, fields: dict[str, Any], cap: int) -> Trial:
    """Train 2 steps at ``width`` on 2 workers capped at ``cap`` bytes each."""
    from datetime import timedelta

    from coordinator.runtime.errors import JobFailed
    from coordinator.runtime.factories import job_factories
    from coordinator.runtime.harness import LocalHarness

    started = time.monotonic()
    job = make_job(width, fields)
    predicted = job.plan().peak_memory_bytes
    error, peak, trained = "", 0, False
    try:
        with LocalHarness(NAMES, job=f"bench-largest-{width}", threads=1, python_path=[ROOT],
                          lease_ttl=timedelta(seconds=10), factories=job_factories(job.config),
                          memory_limits=dict.fromkeys(NAMES, cap)) as harness, job.attach(harness):
            result = job.fit(2)
            trained = len(result.steps) == 2
            peak = max((body.peak_bytes or 0) for step in result.steps for _, body in step.replies)
    except JobFailed as exc:
        error = " ".join(str(exc).split())[:300]
    return Trial(width, params_of(width), trained, predicted, peak, time.monotonic() - started, error)


def search(name: str, fields: dict[str, Any], cap: int, start: int, log: list[Trial],
           tolerance: float) -> tuple[Trial, Trial]:
    """The widest trial that trained and the narrowest that did not (bracket, then bisect)."""
    def run(width: int) -> Trial:
        t = trial(width, fields, cap)
        log.append(t)
        print(f"[{name}] width {width} ({t.params / 1e6:.1f} M params): "
              f"{'trained' if t.trained else 'failed'}, predicted {t.predicted_bytes / 2**30:.2f} GiB, "
              f"peak {t.measured_peak_bytes / 2**30:.2f} GiB, {t.seconds:.0f} s {t.error[:160]}",
              file=sys.stderr, flush=True)
        return t

    first = run(start)
    good: Trial | None = first if first.trained else None
    bad: Trial | None = None if first.trained else first
    while good is None:
        assert bad is not None
        if bad.width <= STEP:
            raise RuntimeError(f"{name}: even width {STEP} does not train under the cap: {bad.error}")
        t = run(max(STEP, int(bad.width / GROWTH) // STEP * STEP))
        good, bad = (t, bad) if t.trained else (None, t)
    while bad is None:
        t = run(int(good.width * GROWTH) // STEP * STEP)
        good, bad = (t, None) if t.trained else (good, t)
    while bad.width - good.width > STEP and (bad.width - good.width) > tolerance * good.width:
        t = run((good.width + bad.width) // 2 // STEP * STEP)
        good, bad = (t, bad) if t.trained else (good, t)
    return good, bad


def start_width(fields: dict[str, Any], cap: int) -> int:
    """A first guess: the width whose state (the bytes a replica holds per parameter) fills half the cap."""
    zero = fields.get("zero", 0)
    per_param = 4 * (1 + (1 if zero < 2 else 0.5) + (2 if zero < 1 else 1)) if zero < 3 else 4 * 2
    per_param += 4 / (2 if zero else 1) * fields.get("offload", False)  # the master copy
    width = int((cap / 2 / per_param / DEPTH) ** 0.5)
    return max(STEP, width // STEP * STEP)


def report(results: dict[str, tuple[Trial, Trial]], cap: int, seconds: float,
           load: tuple[float, float]) -> str:
    gib = 2**30
    rows = [f"## The largest model under a memory cap ({dt.date.today().isoformat()})", "",
            f"`python bench/largest.py`: an MLP (`Linear(64, w)`, {DEPTH} x `Linear(w, w) + Tanh`, "
            "`Linear(w, 8)`, "
            "float32, Adam, global batch 16) on 2 local workers, each capped at "
            f"{cap / gib:g} GiB (`--memory-limit`); the widest `w` (a multiple of {STEP}, bisected) that "
            "trains 2 steps. *Predicted* is the planner's per-worker peak for that plan (fields fixed), "
            "*measured* the workers' peak resident bytes since assignment (`StepReply.peak_bytes`). "
            f"{platform.machine()}, torch {torch.__version__}, {os.cpu_count()} cores, load "
            f"{load[0]:.1f}-{load[1]:.1f}, {seconds / 60:.0f} min.", "",
            "| plan | widest that trains | parameters | predicted peak | measured peak | planner says fits "
            "| next width (fails) | its predicted peak |",
            "|---|---|---|---|---|---|---|---|"]
    for name, (good, bad) in results.items():
        rows.append(f"| {name} | {good.width} | {good.params / 1e6:.1f} M | "
                    f"{good.predicted_bytes / gib:.2f} GiB "
                    f"| {good.measured_peak_bytes / gib:.2f} GiB | "
                    f"{'yes' if good.predicted_bytes <= cap else 'no'} | {bad.width} | "
                    f"{bad.predicted_bytes / gib:.2f} GiB |")
    rows += ["", "Offload on these CPU workers moves nothing off the capped memory (the host is the device) "
             "and adds the master copy of the parameters, so it cannot train a larger model here."]
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cap-gib", type=float, default=4.0)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--json", default=None, help="write every trial here")
    parser.add_argument("--tolerance", type=float, default=0.03,
                        help="bisect until the failing width is within this fraction of the training one")
    parser.add_argument("--width", type=int, default=None,
                        help="train each configuration once at this width (no search): predicted vs measured")
    args = parser.parse_args()
    from comm.allocator import tune_malloc
    from comm.logs import configure_logging

    tune_malloc()
    configure_logging(terminal=True)
    cap = int(args.cap_gib * 2**30)
    started, load = time.monotonic(), os.getloadavg()[0]
    results: dict[str, tuple[Trial, Trial]] = {}
    log: list[Trial] = []
    if args.width is not None:
        for name in args.configs.split(","):
            t = trial(args.width, CONFIGS[name], cap)
            ratio = t.measured_peak_bytes / t.predicted_bytes if t.predicted_bytes else 0.0
            print(f"| {name} | {t.width} | {t.params / 1e6:.1f} M | {'yes' if t.trained else 'no'} | "
                  f"{t.predicted_bytes / 2**30:.2f} GiB | {t.measured_peak_bytes / 2**30:.2f} GiB | "
                  f"{ratio:.2f} | {t.seconds:.0f} s | {t.error[:120]}", flush=True)
        return
    for name in args.configs.split(","):
        fields = CONFIGS[name]
        results[name] = search(name, fields, cap, start_width(fields, cap), log, args.tolerance)
        if args.json:
            Path(args.json).write_text(json.dumps({"trials": [asdict(t) for t in log]}, indent=1))
    print(report(results, cap, time.monotonic() - started, (load, os.getloadavg()[0])))


if __name__ == "__main__":
    main()
