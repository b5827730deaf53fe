"""The coordinator's per-step control cost, two code trees side by side: before and after a change.

Each configuration is a cellmesh pipeline of ``bench.models:mlp`` (8 x Linear(1024) + GELU,
global batch 64, float32, SGD, one torch thread per process) with its plan fixed: 1F1B on 2
stages x 8 microbatches and on 4 stages x 8 microbatches, one worker per stage. Per timed step
(the first after the warm-up left out, as in ``bench/train.py``), from the coordinator:

* coordinator ms: ``StepRecord.coordinator_s`` (the step's wall time less the poller's waits), and
  its share of the step; CPU ms: the coordinator thread's CPU time per step;
* messages and bytes: the requests the coordinator's event loop sent and the replies it read, and
  their frames' bytes (counted around ``EventLoop``, so both trees are measured alike);
* dispatch: the step's start to the first event on any stage; tail: the last action's end to the
  step's end (the replies); both from the step's event log (``docs/benchmarks.md``, "where a
  step goes").

``--before DIR`` names the other tree (e.g. ``git archive <commit> | tar -x -C DIR``). Every
round runs both trees, each in a fresh process with its own workers (``PYTHONPATH`` set, so the
workers run that tree too), their order swapped round by round; a ratio is after / before within
each round, and the tables show the median over rounds and the spread (min-max).

    python bench/control.py --before /tmp/base [--steps 20] [--warmup 3] [--rounds 3] [--quick] [--only L]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GLOBAL_BATCH = 64
CONFIGS = {"1F1B 2x8": [4, 4], "1F1B 4x8": [2, 2, 2, 2]}  # label -> blocks per stage
METRICS = [("coordinator_ms", "coordinator ms/step", ".3f"), ("coordinator_pct", "% of step", ".2f"),
           ("cpu_ms", "coordinator CPU ms/step", ".3f"), ("sent_msgs", "messages sent/step", ".1f"),
           ("sent_bytes", "bytes sent/step", ".0f"), ("recv_msgs", "replies read/step", ".1f"),
           ("recv_bytes", "bytes read/step", ".0f"), ("dispatch_ms", "dispatch ms", ".3f"),
           ("tail_ms", "tail ms", ".3f"), ("step_ms", "step ms", ".1f")]


class _Counts:
    """The coordinator's control traffic: requests sent and replies read, and their frames' bytes."""

    def __init__(self) -> None:
        self.sent_msgs = self.sent_bytes = self.recv_msgs = self.recv_bytes = 0

    def install(self) -> None:
        from coordinator.runtime import loop

        frames_of, decode = loop.request_frames, loop.EventLoop._decode

        def counted_frames(*args: Any, **kwargs: Any) -> list[Any]:
            frames = frames_of(*args, **kwargs)
            self.sent_msgs += 1
            self.sent_bytes += sum(memoryview(f).nbytes for f in frames)
            return frames

        def counted_decode(this: Any, worker: str, parts: list[Any]) -> Any:
            self.recv_msgs += 1
            self.recv_bytes += sum(len(p) for p in parts)
            return decode(this, worker, parts)

        loop.request_frames = counted_frames  # type: ignore[assignment]
        loop.EventLoop._decode = counted_decode  # type: ignore[method-assign]

    def snapshot(self) -> tuple[int, int, int, int]:
        return self.sent_msgs, self.sent_bytes, self.recv_msgs, self.recv_bytes


def _measure(job: Any, harness: Any, counts: _Counts, steps: int, warmup: int) -> dict[str, float]:
    marks: list[tuple[float, tuple[int, int, int, int]]] = []
    with job.attach(harness):
        job.fit(max(0, warmup - 1))
        result = job.fit(steps + 1, callback=lambda _: marks.append((time.thread_time(), counts.snapshot())))
    recs = result.steps[1:]
    n = len(recs)
    (cpu0, c0), (cpu1, c1) = marks[0], marks[-1]
    per = [(b - a) / n for a, b in zip(c0, c1, strict=True)]
    dispatch, tail = [], []
    for r in recs:
        ev = r.events
        if ev:
            runs = [e for e in ev if e.name not in ("optimizer", "push_pull")]
            dispatch.append(min(e.start for e in ev) - r.start)
            tail.append(r.end - max(e.end for e in runs))
    coord = sum(r.coordinator_s for r in recs)
    return {"coordinator_ms": coord / n * 1e3, "coordinator_pct": 100 * coord / sum(r.seconds for r in recs),
            "cpu_ms": (cpu1 - cpu0) / n * 1e3, "sent_msgs": per[0], "sent_bytes": per[1], "recv_msgs": per[2],
            "recv_bytes": per[3],
            "dispatch_ms": statistics.median(dispatch) * 1e3 if dispatch else float("nan"),
            "tail_ms": statistics.median(tail) * 1e3 if tail else float("nan"),
            "step_ms": statistics.median(r.seconds for r in recs) * 1e3, "loss": recs[-1].loss}


def child(root: str, steps: int, warmup: int, labels: list[str]) -> None:
    """Measure every configuration with the code under ``root``; print the figures as one JSON line."""
    sys.path.insert(0, root)
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
    from coordinator.planning.resources import Resources
    from coordinator.runtime.factories import job_factories
    from coordinator.runtime.harness import LocalHarness
    from coordinator.runtime.job import Job

    counts = _Counts()
    counts.install()
    jobs = {label: Job(model="bench.models:mlp", loss="torch.nn:MSELoss", data="bench.models:regression",
                       optimizer="SGD", optimizer_kwargs={"lr": 0.01}, global_batch=GLOBAL_BATCH, seed=0,
                       resources=Resources.local(len(balance)), data_parallel=1, num_stages=len(balance),
                       num_microbatches=8, schedule="1f1b", balance=balance, step_timeout_s=120)
            for label, balance in CONFIGS.items() if label in labels}
    for job in jobs.values():
        job.plan()  # profiled before the workers start
    factories = sorted({f for job in jobs.values() for f in job_factories(job.config)})
    workers = max(len(CONFIGS[label]) for label in labels)
    out: dict[str, dict[str, float]] = {}
    with LocalHarness([f"local-{i}" for i in range(workers)], job="bench-control", threads=1,
                      python_path=[root], lease_ttl=timedelta(seconds=5), factories=factories) as harness:
        for label, job in jobs.items():
            out[label] = _measure(job, harness, counts, steps, warmup)
    print(json.dumps(out))


def _cell(values: list[float], fmt: str) -> str:
    med = statistics.median(values)
    return f"{med:{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})" if len(values) > 1 else f"{med:{fmt}}"


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--before", help="the other code tree (the 'before'); default: this tree only")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="1 round, 5 steps, 1 warm-up step")
    parser.add_argument("--only", default=",".join(CONFIGS), help="comma-separated configurations: "
                        + ", ".join(CONFIGS))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.steps, args.warmup, args.only.split(","))
        return
    if args.quick:
        args.rounds, args.steps, args.warmup = 1, 5, 1
    trees = {"after": ROOT, **({"before": os.path.abspath(args.before)} if args.before else {})}
    runs: dict[str, list[dict[str, dict[str, float]]]] = {name: [] for name in trees}
    started, load = time.monotonic(), os.getloadavg()[0]
    for i in range(args.rounds):
        order = list(trees.items()) if i % 2 else list(reversed(trees.items()))
        for name, root in order:
            env = {**os.environ, "PYTHONPATH": root}
            cmd = [sys.executable, os.path.abspath(__file__), "--child", root, "--steps", str(args.steps),
                   "--warmup", str(args.warmup), "--only", args.only]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, check=False)
            if done.returncode != 0:
                sys.exit(f"{name} ({root}) failed:\n{done.stderr[-4000:]}")
            runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"[round {i + 1}/{args.rounds}] {name}: done", file=sys.stderr)
    lines = [f"`python bench/control.py{' --before DIR' if args.before else ''}` ({args.rounds} rounds, "
             f"{args.steps} steps after {args.warmup} warm-up), {time.strftime('%Y-%m-%d')}, load average "
             f"{load:.1f}-{os.getloadavg()[0]:.1f}, {time.monotonic() - started:.0f} s", ""]
    for label in args.only.split(","):
        head = "| metric | " + " | ".join(trees) + (" | after / before |" if args.before else " |")
        lines += [f"**{label}**", "", head, "|---" * (len(trees) + 1 + bool(args.before)) + "|"]
        for key, what, fmt in METRICS:
            cells = [_cell([r[label][key] for r in runs[name]], fmt) for name in trees]
            if args.before:
                ratios = [a[label][key] / b[label][key] if b[label][key] else float("nan")
                          for a, b in zip(runs["after"], runs["before"], strict=True)]
                cells.append(_cell(ratios, ".2f"))
            lines.append(f"| {what} | " + " | ".join(cells) + " |")
        losses = {name: runs[name][-1][label]["loss"] for name in trees}
        lines += ["", "last loss: " + ", ".join(f"{n} {v:.6f}" for n, v in losses.items()), ""]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
