"""How long ``choose_plan`` takes, from the examples' sizes to a 1,000-node model on 1,024 workers.

Each case is a ``Profile.synthetic`` chain of ``n`` nodes (1 ms forward per sample, 4 MB of parameters,
1 MB of saved activations, 256 KiB crossing each cut) planned on ``Resources.local(workers)`` with
80 GiB each, for a global batch of 4 samples per worker; ``stages`` fixes ``plan.num_stages`` where
given. Per case: the shapes the request allows, the time of the fast search (the default), of the
exhaustive one (``exhaustive=True``, which plays every shape; skipped past ``--exhaustive-up-to``
workers), of ``candidate_plans(limit=N)`` (``cellmesh plan``'s runners-up, ``--runners-up N``) and, with
``--baseline DIR``, of ``choose_plan`` from another checkout of cellmesh in a subprocess (the search
before this one), each once, in wall time and in this process's CPU time (``time.process_time``: what a
loaded machine does not inflate as much). The fast and exhaustive plans are compared.

    python bench/planning.py [--cases examples,issue,cluster,hosts,mixed,profiles,heavy,random]
        [--baseline DIR] [--fresh]
        [--timeout 300]
        [--json F]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = str(Path(__file__).resolve().parents[1])
if __name__ == "__main__":  # run as a script: the repository, not bench/, first on the path
    sys.path[0] = ROOT

from coordinator.planning.config import PlanConfig  # noqa: E402
from coordinator.planning.planner import candidate_plans, choose_plan  # noqa: E402
from coordinator.planning.profile import Profile  # noqa: E402
from coordinator.planning.request import plan_shapes, resolve  # noqa: E402
from coordinator.planning.resources import Resources  # noqa: E402

# (nodes, workers, fixed stages or None[, resources: "local" (default), "gpu-hosts" or "cpu-hosts"])
CASES: dict[str, list[tuple[Any, ...]]] = {
    "examples": [(8, 2, None), (12, 4, None), (16, 8, None)],
    "issue": [(64, 8, None), (128, 64, None), (256, 256, None)],
    "cluster": [(1000, 1024, 16), (1000, 1024, 128), (1000, 1024, None)],
    # the same on a cluster's resource list: hosts of 8 workers, 100 GB/s inside a host, 12.5 GB/s between
    "hosts": [(1000, 1024, 16, "gpu-hosts"), (1000, 1024, None, "gpu-hosts"), (1000, 1024, 16, "cpu-hosts"),
              (1000, 1024, None, "cpu-hosts")],
    # lists a search on alike workers never meets: two generations of GPUs or of CPU hosts (half the
    # workers half as fast), and hosts whose workers want twice the cores they have
    "mixed": [(1000, 1024, None, "mixed-gpu-hosts"), (1000, 1024, None, "mixed-cpu-hosts"),
              (1000, 1024, None, "busy-cpu-hosts")],
    # other chains on the issue's own list: uneven nodes (seeded), two embeddings of 800 MB on workers of
    # 16 GiB, the even chain on workers of 2 GiB (most shapes fit no cut)
    "profiles": [(1000, 1024, None, "local", "uneven"), (1000, 1024, None, "local-16", "embed"),
                 (1000, 1024, None, "local-2", "even"), (1000, 1024, None, "gpu-hosts", "uneven"),
                 (1000, 1024, None, "cpu-hosts", "uneven")],
    # a heavier uneven chain (up to 32 MB of parameters, 8 MB saved and 4 MiB crossing a node) on the issue's
    # list and the cluster lists
    "heavy": [(1000, 1024, None, kind, "heavy")
              for kind in ("local", "gpu-hosts", "cpu-hosts", "mixed-gpu-hosts", "mixed-cpu-hosts")],
    # lists and chains drawn from a seed each (``random-S``: see resources() and profile()), so that a search
    # is not only timed on the lists it was tuned on: any stage count
    "random": [(1000, 1024, None, f"random-{seed}", f"random-{seed}") for seed in range(16)],
}


def resources(kind: str, w: int) -> Resources:
    """The case's resource list: ``local`` (this host's ``w`` workers, 80 GiB each) or hosts of 8 workers
    (``gpu-hosts``: a GPU each, 20x the profiled speed; ``cpu-hosts``: 4 of a host's 32 cores each;
    ``mixed-...``: the second half of the hosts half as fast, with half the memory; ``busy-cpu-hosts``: 8
    of a host's 32 cores each, twice what the host has); ``random-S``: drawn from seed ``S``: hosts of 1 to
    16 workers, GPUs (20x the profiled speed, 8-80 GiB) or CPU workers of 1-8 threads on hosts of 16-128
    cores (16-256 GiB), one to three generations (each half as fast and with two thirds of the memory of the
    one before), links between hosts of 1.25-50 GB/s."""
    import random

    from coordinator.planning.resources import LinkSpeed, Resources, Worker
    if kind.startswith("local"):  # "local-16": 16 GiB each
        return Resources.local(w, memory_bytes=int(kind.partition("-")[2] or 80) * 2**30)
    if kind.startswith("random-"):
        rng = random.Random(1000 + int(kind.partition("-")[2]))
        per_host, on_gpu = rng.choice([1, 2, 4, 8, 16]), rng.random() < 0.5
        generations = rng.choice([1, 1, 2, 3])
        gib = rng.choice([8, 16, 32, 80]) if on_gpu else rng.choice([16, 64, 256])
        cores, threads = rng.choice([16, 32, 64, 128]), rng.choice([1, 2, 4, 8])
        hosts = w // per_host

        def generation(i: int) -> int:
            return (i // per_host) * generations // hosts

        return Resources(workers=tuple(
            Worker(name=f"h{i // per_host}-{i % per_host}", device="cuda" if on_gpu else "cpu",
                   gpus=int(on_gpu), cpus=threads, memory_bytes=int(gib * 2**30 / (1 + 0.5 * generation(i))),
                   host=f"h{i // per_host}", host_cpus=None if on_gpu else cores,
                   speed=(20.0 if on_gpu else 1.0) / (1 + generation(i))) for i in range(w)),
            bandwidth_bps=rng.choice([1.25e9, 12.5e9, 50e9]), latency_s=20e-6,
            intra_host=LinkSpeed(bandwidth_bps=100e9 if on_gpu else 20e9, latency_s=5e-6))
    gpu = kind in ("gpu-hosts", "mixed-gpu-hosts")
    slower = (lambda i: 0.5 if i >= w // 2 else 1.0) if kind.startswith("mixed") else (lambda i: 1.0)
    cpus = 8 if gpu or kind == "busy-cpu-hosts" else 4
    return Resources(workers=tuple(
        Worker(name=f"h{i // 8}-{i % 8}", device="cuda" if gpu else "cpu", gpus=int(gpu), cpus=cpus,
               memory_bytes=int((80 if gpu else 64) * 2**30 * slower(i)), host=f"h{i // 8}",
               host_cpus=None if gpu else 32, speed=(20.0 if gpu else 1.0) * slower(i)) for i in range(w)),
        bandwidth_bps=12.5e9, latency_s=20e-6, intra_host=LinkSpeed(bandwidth_bps=100e9, latency_s=5e-6))


_CHILD = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
from coordinator.planning.config import PlanConfig
from coordinator.planning.planner import choose_plan
from coordinator.planning.profile import Profile
from coordinator.planning.resources import Resources
#RESOURCES
#PROFILE
n, w, stages = int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
kind, chain = sys.argv[5], sys.argv[6]
prof = profile(n, chain)
res = resources(kind, w)
t0, c0 = time.perf_counter(), time.process_time()
plan = choose_plan(prof, res, PlanConfig(num_stages=stages), global_batch=4 * w)
print(json.dumps({"s": time.perf_counter() - t0, "cpu": time.process_time() - c0, "plan": plan.summary()}))
"""


def profile(nodes: int, chain: str = "even") -> Profile:
    """The case's chain: ``even`` (the module's), ``uneven`` (each node's time, bytes and crossing drawn
    from a seeded generator), ``heavy`` (another seed, drawn wider: up to 8 ms a node, 32 MB of parameters,
    8 MB saved, 4 MiB crossing), ``embed`` (the even chain, its first and last nodes 800 MB of
    parameters) or ``random-S`` (drawn from seed ``S``: a heaviness h in [0, 1], each node 0.1 to 1 + 8 h
    ms, up to 4 + 28 h MB of parameters and 1 + 7 h MB saved, up to 0.25 + 4 h MiB crossing; SGD or
    AdamW)."""
    import random
    mb = 10**6
    if chain.startswith("random-"):
        rng = random.Random(int(chain.partition("-")[2]))
        h = rng.random()
        forward = [rng.uniform(0.1e-3, 1e-3 + 8e-3 * h) for _ in range(nodes)]
        params = [rng.randint(0, int(4 * mb + 28 * mb * h)) for _ in range(nodes)]
        saved = [rng.randint(mb // 10, int(mb + 7 * mb * h)) for _ in range(nodes)]
        crossing = [rng.randint(1024, int(2**18 + 4 * 2**20 * h)) for _ in range(nodes - 1)]
        return Profile.synthetic(forward, param_bytes=params, activation_bytes=saved, cut_bytes=crossing,
                                 optimizer=rng.choice(["sgd", "adamw"]))
    if chain == "uneven":
        rng = random.Random(7)
        return Profile.synthetic([rng.uniform(0.2e-3, 5e-3) for _ in range(nodes)],
                                 param_bytes=[rng.randint(0, 16 * mb) for _ in range(nodes)],
                                 activation_bytes=[rng.randint(mb // 10, 4 * mb) for _ in range(nodes)],
                                 cut_bytes=[rng.randint(1024, 2**20) for _ in range(nodes - 1)])
    if chain == "heavy":
        rng = random.Random(11)
        return Profile.synthetic([rng.uniform(0.1e-3, 8e-3) for _ in range(nodes)],
                                 param_bytes=[rng.randint(0, 32 * mb) for _ in range(nodes)],
                                 activation_bytes=[rng.randint(mb // 10, 8 * mb) for _ in range(nodes)],
                                 cut_bytes=[rng.randint(1024, 4 * 2**20) for _ in range(nodes - 1)])
    params = [4 * mb] * nodes
    if chain == "embed":
        params[0] = params[-1] = 800 * mb
    return Profile.synthetic([1e-3] * nodes, param_bytes=params, activation_bytes=[mb] * nodes,
                             cut_bytes=[256 * 1024] * (nodes - 1))


_CHILD = (_CHILD.replace("#RESOURCES", inspect.getsource(resources))
          .replace("#PROFILE", inspect.getsource(profile)))


def baseline(tree: str, nodes: int, workers: int, stages: int | None, kind: str, chain: str, timeout: float
             ) -> dict[str, Any]:
    """``choose_plan`` of the checkout ``tree`` on the case, in a subprocess (None past ``timeout``)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    try:
        command = [sys.executable, "-c", _CHILD, tree, str(nodes), str(workers), json.dumps(stages), kind,
                   chain]
        out = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, check=True)
    except subprocess.TimeoutExpired:
        return {"s": None, "cpu": None, "plan": f"stopped after {timeout:.0f} s"}
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def run_case(nodes: int, workers: int, stages: int | None, kind: str, chain: str, args: argparse.Namespace
             ) -> dict[str, Any]:
    prof, res = profile(nodes, chain), resources(kind, workers)
    request, batch = PlanConfig(num_stages=stages), 4 * workers
    shapes = len(plan_shapes(request, resolve(request, nodes, nodes, workers), batch))
    t0, c0 = time.perf_counter(), time.process_time()
    fast = choose_plan(prof, res, request, global_batch=batch)
    row: dict[str, Any] = {"nodes": nodes, "workers": workers, "stages": stages, "global_batch": batch,
                           "shapes": shapes, "fast_s": time.perf_counter() - t0,
                           "fast_cpu_s": time.process_time() - c0, "plan": fast.summary()}
    if args.fresh:  # the same search again in a fresh interpreter of this tree, as the baseline is timed
        again = baseline(ROOT, nodes, workers, stages, kind, chain, args.timeout)
        assert again["plan"] == row["plan"], "a fresh interpreter chose another plan"
        row["fast_s"], row["fast_cpu_s"] = again["s"], again["cpu"]
    if args.runners_up:
        t0, c0 = time.perf_counter(), time.process_time()
        best = candidate_plans(prof, res, request, global_batch=batch, limit=args.runners_up)
        row["runners_up_s"], row["runners_up_cpu_s"] = time.perf_counter() - t0, time.process_time() - c0
        assert best[0].plan == fast, "the runners-up start with the chosen plan"
    if workers <= args.exhaustive_up_to:
        t0 = time.perf_counter()
        every = choose_plan(prof, res, request, global_batch=batch, exhaustive=True)
        row["exhaustive_s"] = time.perf_counter() - t0
        row["same_plan"] = every == fast
    if args.baseline:
        before = baseline(args.baseline, nodes, workers, stages, kind, chain, args.timeout)
        row["baseline_s"], row["baseline_cpu_s"] = before["s"], before.get("cpu")
        row["baseline_plan"] = before["plan"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="examples,issue,cluster")
    parser.add_argument("--baseline", default="", help="another checkout of cellmesh to time as 'before'")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per baseline plan")
    parser.add_argument("--exhaustive-up-to", type=int, default=64, help="workers; larger cases skip it")
    parser.add_argument("--runners-up", type=int, default=5, help="time candidate_plans(limit=N); 0: not")
    parser.add_argument("--fresh", action="store_true",
                        help="time the search in a fresh interpreter (this process's own runs drift: a long "
                             "run's later cases read up to 20%% slower than fresh)")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    rows = []
    print(f"{'nodes x workers':>16} {'stages':>6} {'batch':>6} {'shapes':>7} {'before s':>9} {'cpu':>6} "
          f"{'exhaust s':>9} {'fast s':>8} {'cpu':>6} {'runners':>8}  same  plan")
    for group in args.cases.split(","):
        for case in CASES[group]:
            nodes, workers, stages = case[:3]
            kind = case[3] if len(case) > 3 else "local"
            chain = case[4] if len(case) > 4 else "even"
            row = run_case(nodes, workers, stages, kind, chain, args)
            row["resources"], row["chain"] = kind, chain
            rows.append(row)
            before, every = row.get("baseline_s"), row.get("exhaustive_s")
            before_s = ("-" if "baseline_plan" not in row else f">{args.timeout:.0f}" if before is None
                        else f"{before:.2f}")
            every_s = "-" if every is None else f"{every:.2f}"
            before_cpu = row.get("baseline_cpu_s")
            before_cpu_s = "-" if before_cpu is None else f"{before_cpu:.2f}"
            runners = row.get("runners_up_s")
            runners_s = "-" if runners is None else f"{runners:.3f}"
            where = (f"{nodes} x {workers}" + ("" if kind == "local" else f" {kind}")
                     + ("" if chain == "even" else f" {chain}"))
            print(f"{where:>16} {stages or 'any':>6} {row['global_batch']:>6} "
                  f"{row['shapes']:>7} {before_s:>9} {before_cpu_s:>6} {every_s:>9} {row['fast_s']:>8.3f} "
                  f"{row['fast_cpu_s']:>6.3f} {runners_s:>8}  {row.get('same_plan', '-')!s:>4}  "
                  f"{row['plan']}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
