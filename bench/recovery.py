"""What surviving failure costs: checkpoints during training, recovering from a lost worker, resuming.

The training benchmark's model and data (``bench/train.py``: 8 x Linear(1024, 1024) + GELU,
8.4 M parameters, 34 MB of float32 parameters, global batch 64, SGD, one torch thread per
worker) on two local workers, with three plans fixed up front from one profile each: data
parallel 2 (collective all-reduce), 1F1B 2 stages x 8 microbatches (the [4, 4] split
``bench/train.py`` uses) and data parallel 2 through parameter servers (each worker hosts one
replica and one shard). Checkpoints go to a temporary directory on the machine's disk
(``--dir``). Three measurements, every round running each plan's pair side by side:

* cost: each plan trains ``warmup + steps`` steps without checkpoints and with one every 10
  steps, one after the other on one harness (the order swapped every round); the time per
  step over the timed steps, which hold one checkpoint per 10 steps (the stages' snapshot
  after the commit, the background write, the coordinator's publishing between steps). The
  ratio is taken within each round. Where a checkpoint's time goes: the stages' snapshot
  phase, the coordinator's time between steps (publishing), the rest (steps slowed down by
  the writing threads, which share the two cores with training).
* recovery: a run of the same length, a checkpoint every 10 steps, whose worker ``local-1`` is
  killed (SIGKILL by the fault-injection hook, ``services/faults.py``) at step
  ``--kill-step``; it hosts replica 1 (data parallel), stage 1 (the pipeline), replica 1 and
  shard ``ps-s0-1`` (parameter servers). From the kill (the process's death, as the harness's
  parent sees it) to the failed step trained again, broken down as: detection (the kill until
  the session notices: the registry lease lapsing), fencing (the failed runtime's services
  released), replacement (a new worker process started until its card is registered),
  placement and restore (every service placed again, restored from the newest checkpoint),
  the first step after it, and the steps replayed from the checkpoint to the failed step.
  The run's final loss is compared with the same plan's failure-free run of the cost part.
* resume: a new session from a checkpoint against one from scratch, as ``Job.fit(resume=...)``
  and ``Job.fit()`` open them (the plan fixed, so neither profiles the model), timed in its
  parts: the local harness started (two worker processes registered), the plan placed (each
  service restored), the first step done. The checkpoints (of step 10) are taken once before
  the rounds, one per plan; a pipeline resumed from the data-parallel checkpoint shows that
  any plan restores.

Figures are means over rounds with the spread (min-max); the 1-minute load average is printed
at the start and the end (this run's own processes add up to 2).

    python bench/recovery.py [--rounds 3] [--steps 30] [--quick] [--parts cost,recovery,resume]
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import itertools
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

if not __package__:  # run as `python bench/x.py`: keep bench/comm.py from shadowing the comm package
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from bench.train import DATA, GLOBAL_BATCH, LOSS, LR, MICROBATCHES, MODEL, SEED, _cpu_model
from coordinator.planning.plan import Plan
from coordinator.runtime.checkpoints import newest
from coordinator.runtime.factories import job_factories
from coordinator.runtime.harness import LocalHarness
from coordinator.runtime.job import Job
from coordinator.runtime.records import StepRecord
from services.faults import ENV as FAULT_ENV

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = ("local-0", "local-1")
VICTIM = "local-1"
EVERY = 10  # steps between checkpoints
RESUME_FROM = 10  # the step of the checkpoints the resume part starts from
RESUME_STEPS = 3  # steps each resume and fresh start trains


@dataclass(frozen=True)
class Setup:
    key: str
    label: str
    plan: dict[str, Any]  # the plan section's fields
    victim: str  # what the killed worker hosts
    phase: str  # where in the step it is killed (services/faults.py)


SETUPS = (
    Setup("dp2", "data parallel 2", dict(data_parallel=2, num_stages=1, num_microbatches=1), "replica 1",
          "backward"),
    Setup("1f1b", "1F1B 2x8", dict(data_parallel=1, num_stages=2, num_microbatches=MICROBATCHES,
                                   schedule="1f1b", balance=[4, 4]), "stage 1", "backward"),
    Setup("ps", "data parallel 2, parameter servers",
          dict(data_parallel=2, num_stages=1, num_microbatches=1, mode="parameter_server"),
          "replica 1 + shard ps-s0-1", "push_pull"),
)


def make_job(plan: Plan | None = None, **fields: Any) -> Job:
    """A job of the training benchmark's model, on ``plan`` (fixed) or the plan section ``fields`` give."""
    return Job(model=MODEL, loss=LOSS, data=DATA, optimizer="SGD", optimizer_kwargs={"lr": LR},
               global_batch=GLOBAL_BATCH, seed=SEED, step_timeout_s=120, code_dir=ROOT, plan=plan, **fields)


class TimedHarness(LocalHarness):
    """The local harness, noting when each :meth:`replace` began and when the new worker registered."""

    def __init__(self, names: Sequence[str], **kwargs: Any) -> None:
        super().__init__(names, **kwargs)
        self.replaced: list[tuple[float, float]] = []

    def replace(self, name: str, timeout: timedelta) -> str | None:
        began = time.time()
        address = super().replace(name, timeout)
        self.replaced.append((began, time.time()))
        return address


def watch_death(pid: int) -> list[float]:
    """A list that gets the time process ``pid`` dies or stops, within about 2 ms: a thread reads its state
    in ``/proc`` (the workers are the fork server's children, not this process's, so it cannot wait for
    them; a waiter that could not wait took the time it started as the death, and the detection column
    read 1.9-5 s of training as detection)."""
    out: list[float] = []

    def state() -> str:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                return f.read().rsplit(b")", 1)[1].split()[0].decode()
        except (OSError, IndexError):
            return "gone"

    def wait() -> None:
        while state() not in ("Z", "X", "T", "t", "gone"):
            time.sleep(0.002)
        out.append(time.time())

    threading.Thread(target=wait, daemon=True, name=f"watch-{pid}").start()
    return out


# -- the three measurements --------------------------------------------------------------------


def run_cost(plan: Plan, harness: LocalHarness, every: int | None,
             args: argparse.Namespace) -> dict[str, float]:
    """Train ``warmup + steps`` steps (a checkpoint every ``every``, or none); time the last ``steps``."""
    with tempfile.TemporaryDirectory(prefix="ckpt-", dir=args.dir) as root:
        fields = dict(checkpoint_directory=root, checkpoint_every_steps=every) if every else {}
        job = make_job(plan, **fields)
        with job.attach(harness):
            result = job.fit(args.warmup + args.steps)
    recs = result.steps[args.warmup:]
    snaps = [max(e.end - e.start for e in snap) for r in recs
             if (snap := [e for e in r.events if e.name == "snapshot"])]
    return {**in_run_excess(recs), "step_s": (recs[-1].end - recs[0].start) / len(recs),
            "loss": result.losses[-1], "steps": len(recs),
            "gaps_s": sum(b.start - a.end for a, b in itertools.pairwise(recs)),
            "snapshot_s": sum(snaps), "checkpoints": len(snaps)}


def in_run_excess(recs: Sequence[StepRecord]) -> dict[str, float]:
    """The time the steps of the run's checkpoints took beyond the run's median step (``excess_s``), that
    median (``typical_s``) and how many steps a checkpoint spans (``span``, mean).

    A checkpoint's steps run from the one whose commit takes its snapshot to the one whose
    reply reports its last part (the coordinator publishes it then), each with the
    coordinator's time before the next. Compared within the run, the figure does not move
    with load that changes between runs (other processes on the machine).
    """
    intervals = [b.start - a.start for a, b in itertools.pairwise(recs)]
    spans: list[range] = []
    for i, rec in enumerate(recs):
        if any(e.name == "snapshot" for e in rec.events):
            last = max((j for j in range(i, len(recs)) if any(p.step == rec.step for p in recs[j].saved)),
                       default=len(recs) - 1)
            spans.append(range(i, min(last + 1, len(intervals))))
    inside = {j for span in spans for j in span}
    typical = statistics.median(t for j, t in enumerate(intervals) if j not in inside)
    return {"excess_s": sum(intervals[j] - typical for j in inside), "typical_s": typical,
            "span": statistics.fmean(len(s) for s in spans) if spans else 0.0}


def run_recovery(setup: Setup, plan: Plan, args: argparse.Namespace) -> dict[str, float]:
    """A run whose worker ``local-1`` is killed at ``--kill-step``: when each phase of the recovery ended."""
    lease = timedelta(seconds=args.lease)
    with tempfile.TemporaryDirectory(prefix="ckpt-", dir=args.dir) as root:
        job = make_job(plan, checkpoint_directory=root, checkpoint_every_steps=EVERY, lease_ttl_s=args.lease)
        fault = f"{args.kill_step}:{setup.phase}:{args.action}"
        harness = TimedHarness(WORKERS, job="bench-recovery", lease_ttl=lease, threads=1, python_path=[ROOT],
                               factories=job_factories(job.config), log_dir=Path(root) / "logs",
                               worker_env={VICTIM: {FAULT_ENV: fault}})
        records: list[StepRecord] = []
        with harness:
            died = watch_death(harness.procs[VICTIM].pid)
            with job.attach(harness):
                result = job.fit(args.warmup + args.steps, callback=records.append)
    if not died or len(result.recoveries) != 1 or len(harness.replaced) != 1:
        raise RuntimeError(f"{setup.key}: expected one kill, one recovery and one replacement; got "
                           f"{len(died)}, {result.recoveries}, {harness.replaced}")
    rec, (began, registered) = result.recoveries[0], harness.replaced[0]
    placed = rec.at + rec.seconds
    after = [r for r in records if r.start >= placed]
    failed = rec.step if rec.step is not None else after[0].step
    redone = next(r for r in after if r.step == failed)
    return {"detection": rec.at - died[0], "fencing": began - rec.at, "replacement": registered - began,
            "placement": placed - registered, "first_step": after[0].end - placed,
            "replay": redone.end - after[0].end, "total": redone.end - died[0],
            "to_first_step": after[0].end - died[0], "failed": failed, "resumed": rec.resumed_step,
            "loss": result.losses[-1]}


def run_start(plan: Plan, checkpoint: Path | None) -> dict[str, float]:
    """A new session trains ``RESUME_STEPS`` steps, from ``checkpoint`` or fresh: when each part ended.

    What ``Job.fit(resume=...)`` does, in its parts: start the local harness the session
    would (two worker processes), open the session (place the plan, each service restored
    from the checkpoint), train. ``Job.fit(resume=...)`` itself currently opens a second
    session that starts from scratch (docs/benchmarks.md, "Checkpoints and recovery").
    """
    job = make_job(plan)
    first: list[float] = []

    def note(record: StepRecord) -> None:
        if not first:
            first.append(record.end)

    began = time.time()
    with LocalHarness(WORKERS, job=job.name, threads=1, python_path=[ROOT],
                      factories=job_factories(job.config)) as harness:
        up = time.time()
        with job.attach(harness, resume=checkpoint):
            placed = time.time()
            job.fit(RESUME_STEPS, callback=note)
    return {"up": up - began, "placed": placed - up, "first_step": first[0] - placed,
            "total": first[0] - began}


def take_checkpoint(plan: Plan, harness: LocalHarness, root: Path) -> Path:
    """Train ``RESUME_FROM`` steps on ``plan`` with a checkpoint directory; the checkpoint of the end."""
    job = make_job(plan, checkpoint_directory=str(root))
    with job.attach(harness):
        job.fit(RESUME_FROM)
    found = newest(root)
    assert found is not None, f"no checkpoint under {root}"
    return found


# -- the report --------------------------------------------------------------------------------


def _cell(values: Sequence[float], fmt: str = ".1f", scale: float = 1.0) -> str:
    """Mean (min-max); one value if they all print alike."""
    values = [v * scale for v in values if v == v]
    if not values:
        return "-"
    low, mean, high = (format(v, fmt) for v in (min(values), statistics.fmean(values), max(values)))
    return mean if low == high else f"{mean} ({low}-{high})"


Rounds = list[dict[str, dict[str, float]]]


def cost_table(rounds: Rounds, setups: Sequence[Setup]) -> list[str]:
    out = ["| plan | ms/step, none | ms/step, every 10 | more time per step | in-run: more time per step "
           "| target < 5% | ms per checkpoint | in-run: ms per checkpoint | steps it spans "
           "| of which snapshot | of which between steps | final loss, none / every 10 |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in setups:
        pairs = [(r[f"{s.key}/none"], r[f"{s.key}/every"]) for r in rounds if f"{s.key}/every" in r]
        if not pairs:
            continue
        more = [e["step_s"] / n["step_s"] - 1 for n, e in pairs]
        per = [(e["step_s"] - n["step_s"]) * e["steps"] / e["checkpoints"] for n, e in pairs]
        snap = [e["snapshot_s"] / e["checkpoints"] for _, e in pairs]
        excess = [e["excess_s"] / e["checkpoints"] for _, e in pairs]
        gaps = [(e["gaps_s"] - n["gaps_s"]) / e["checkpoints"] for n, e in pairs]
        more_in = [x / (EVERY * e["typical_s"]) for x, (_, e) in zip(excess, pairs, strict=True)]
        verdict = " / ".join("met" if statistics.fmean(m) < 0.05 else "missed" for m in (more, more_in))
        losses = " / ".join(_cell([p[i]["loss"] for p in pairs], ".6f") for i in (0, 1))
        out.append(f"| {s.label} | {_cell([n['step_s'] for n, _ in pairs], scale=1e3)} "
                   f"| {_cell([e['step_s'] for _, e in pairs], scale=1e3)} | {_cell(more, '+.1%')} "
                   f"| {_cell(more_in, '+.1%')} "
                   f"| {verdict} | {_cell(per, scale=1e3)} | {_cell(excess, scale=1e3)} "
                   f"| {_cell([e['span'] for _, e in pairs])} | {_cell(snap, scale=1e3)} "
                   f"| {_cell(gaps, scale=1e3)} | {losses} |")
    return out


def recovery_table(rounds: Rounds, setups: Sequence[Setup], lease: float) -> list[str]:
    """One row per plan; the final loss against the same plan's failure-free runs of the cost part."""
    phases = ("detection", "fencing", "replacement", "placement", "first_step", "to_first_step", "replay",
              "total")
    out = ["| plan | killed | at step -> from | detection | fencing | replacement | placement + restore "
           "| first step | kill to first step | replayed steps | kill to failed step redone "
           f"| target < {lease + 5:.0f} s | final loss vs failure-free |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in setups:
        runs = [r[f"{s.key}/recovery"] for r in rounds if f"{s.key}/recovery" in r]
        if not runs:
            continue
        where = ", ".join(sorted({f"{r['failed']:.0f} -> {r['resumed']:.0f}" for r in runs}))
        verdict = " / ".join("met" if statistics.fmean(r[p] for r in runs) < lease + 5 else "missed"
                             for p in ("to_first_step", "total"))
        free = [r[f"{s.key}/none"]["loss"] for r in rounds if f"{s.key}/none" in r]
        loss = (f"{max(abs(r['loss'] - b) for r in runs for b in free):.1e} off" if free
                else _cell([r["loss"] for r in runs], ".6f"))
        cells = " | ".join(_cell([r[p] for r in runs], ".2f") for p in phases)
        out.append(f"| {s.label} | {s.victim} at {s.phase} | {where} | {cells} | {verdict} | {loss} |")
    return out


def resume_table(rounds: Rounds, setups: Sequence[Setup]) -> list[str]:
    out = ["| plan | start | workers up | placed (restored) | first step | total | total vs fresh "
           "| placed + first step vs fresh |", "|---|---|---|---|---|---|---|---|"]
    labels = {s.key: s.label for s in setups}
    for s in setups:
        for kind, source in starts(s.key, list(labels)):
            key, fresh = f"{s.key}/{kind}", f"{s.key}/fresh"
            runs = [r[key] for r in rounds if key in r]
            if not runs:
                continue
            name = ("fresh" if source is None else "resumed from its own checkpoint" if source == s.key
                    else f"resumed from the checkpoint of {labels[source]}")
            paired = [(r[key], r[fresh]) for r in rounds if key in r and fresh in r]
            diff = "|" if source is None else (
                _cell([a["total"] - b["total"] for a, b in paired], "+.2f") + " s | "
                + _cell([a["placed"] + a["first_step"] - b["placed"] - b["first_step"] for a, b in paired],
                        "+.2f") + " s")
            cells = " | ".join(_cell([r[p] for r in runs], ".3f" if p == "first_step" else ".2f")
                               for p in ("up", "placed", "first_step", "total"))
            out.append(f"| {labels[s.key]} | {name} | {cells} | {diff} |")
    return out


def starts(plan: str, plans: Sequence[str]) -> list[tuple[str, str | None]]:
    """The starts the resume part times on ``plan``: fresh, from its own checkpoint, from another plan's."""
    out: list[tuple[str, str | None]] = [("fresh", None), ("resumed", plan)]
    if plan == "1f1b" and "dp2" in plans:
        out.append(("from-dp2", "dp2"))
    return out


# -- the run -----------------------------------------------------------------------------------


def cost_harness(factories: Sequence[str]) -> LocalHarness:
    return LocalHarness(WORKERS, job="bench-recovery", threads=1, python_path=[ROOT], factories=factories)


def measure(measured: dict[str, dict[str, float]], tag: str, key: str,
            fn: Callable[[], dict[str, float]]) -> None:
    """``measured[key] = fn()``, said on stderr with the time it took."""
    t0 = time.monotonic()
    measured[key] = fn()
    figures = ", ".join(f"{k} {v:.3f}" for k, v in measured[key].items())
    print(f"[{tag}] {key}: {figures} ({time.monotonic() - t0:.1f} s)", file=sys.stderr)


def report(rounds: Rounds, setups: Sequence[Setup], args: argparse.Namespace,
           elapsed: float, load: tuple[float, float]) -> str:
    out = ["# checkpoints, recovery and resume: the training benchmark's model on 2 local workers", "",
           f"date {dt.date.today()}, {platform.node()}, {os.cpu_count()} cores ({_cpu_model()}), "
           f"torch {torch.__version__}, Python {platform.python_version()}; checkpoints in "
           f"{args.dir or tempfile.gettempdir()}",
           f"{len(rounds)} rounds (run took {elapsed:.0f} s); {args.warmup} warm-up + {args.steps} timed "
           "steps; mean (min-max) over rounds",
           f"1-minute load average {load[0]:.1f} at the start, {load[1]:.1f} at the end (this run's own "
           "processes add up to 2)", ""]
    if "cost" in args.parts:
        out += ["## checkpoint cost: a checkpoint every 10 steps against none", "",
                "ms per checkpoint: the extra time per step x steps / checkpoints; in-run: the steps from "
                "a checkpoint's snapshot to its publication against the same run's median step (load that "
                "changes between runs does not move it); snapshot: the stages' copy after the commit "
                "(slowest stage); between steps: the coordinator's extra time between steps (staging, "
                "publishing).", "", *cost_table(rounds, setups), ""]
    if "recovery" in args.parts:
        out += [f"## recovery: {VICTIM} killed ({args.action}), lease {args.lease:.0f} s, a checkpoint every "
                f"{EVERY} steps", "",
                "seconds. The kill to the first step is detection + fencing + replacement + placement + "
                "the first step; with the replayed steps, it is the kill to the failed step trained again. "
                "Final loss: the largest difference from the failure-free runs of the cost part.", "",
                *recovery_table(rounds, setups, args.lease), ""]
    if "resume" in args.parts:
        out += [f"## resume from the checkpoint of step {RESUME_FROM} against a fresh start", "",
                "seconds from the call: workers up (the local harness started), then the plan placed "
                "(restored), then the first step done.", "", *resume_table(rounds, setups)]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30, help="timed steps of the cost and recovery runs")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps before them")
    parser.add_argument("--kill-step", type=int, default=15, help="the step during which the worker dies")
    parser.add_argument("--action", choices=("kill", "stop"), default="kill", help="SIGKILL or SIGSTOP")
    parser.add_argument("--lease", type=float, default=5.0, help="the lease TTL of the recovery part, s")
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: the temporary directory)")
    parser.add_argument("--parts", default="cost,recovery,resume")
    parser.add_argument("--plans", default=",".join(s.key for s in SETUPS))
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 round, 20 timed steps")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps = 1, 20
    args.parts = args.parts.split(",")
    if not args.warmup < args.kill_step < args.warmup + args.steps:
        parser.error("--kill-step must fall inside the timed steps")
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    from comm.allocator import tune_malloc
    from comm.logs import configure_logging

    tune_malloc()
    configure_logging(terminal=True)
    setups = [s for s in SETUPS if s.key in args.plans.split(",")]
    started, load = time.monotonic(), os.getloadavg()[0]
    plans = {s.key: make_job(**s.plan).plan() for s in setups}  # one profile each, before anything runs
    for key, plan in plans.items():
        print(f"[plan] {key}: {plan.summary()}", file=sys.stderr)
    factories = job_factories(make_job().config)
    rounds: Rounds = []
    with tempfile.TemporaryDirectory(prefix="cellmesh-bench-", dir=args.dir) as keep:
        checkpoints: dict[str, Path] = {}
        if "resume" in args.parts:
            with cost_harness(factories) as harness:
                for s in setups:
                    checkpoints[s.key] = take_checkpoint(plans[s.key], harness, Path(keep) / s.key)
        for i in range(args.rounds):
            measured: dict[str, dict[str, float]] = {}
            order = setups[i % len(setups):] + setups[:i % len(setups)]
            timed = functools.partial(measure, measured, f"round {i + 1}/{args.rounds}")
            if "cost" in args.parts:
                with cost_harness(factories) as harness:
                    for s in order:
                        for every in (None, EVERY)[::-1 if i % 2 else 1]:
                            timed(f"{s.key}/{'every' if every else 'none'}",
                                  functools.partial(run_cost, plans[s.key], harness, every, args))
            if "recovery" in args.parts:
                for s in order:
                    timed(f"{s.key}/recovery", functools.partial(run_recovery, s, plans[s.key], args))
            if "resume" in args.parts:
                for s in order:
                    for kind, source in starts(s.key, list(checkpoints))[::-1 if i % 2 else 1]:
                        ckpt = checkpoints[source] if source is not None else None
                        timed(f"{s.key}/{kind}", functools.partial(run_start, plans[s.key], ckpt))
            rounds.append(measured)
    print(report(rounds, setups, args, time.monotonic() - started, (load, os.getloadavg()[0])))


if __name__ == "__main__":
    main()
