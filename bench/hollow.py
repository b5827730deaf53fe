"""The real coordinator against hundreds of hollow workers: what a step costs it, and how that grows.

Starts N hollow workers (``services/host/hollow.py``: the real worker host and registry lease, a compute
that does no tensor work) in child processes of up to 128 each (``--per-process``; [Note: a fleet in
several processes] in ``services/host/hollow_pool.py``), and the real coordinator in this one
(``Job.attach`` on a :class:`~services.host.hollow_pool.HollowPool`), with the embedded registry
(served by this process, as a local run's) or a real etcd (``--registry etcd``: started here,
``tests/harness/etcd.py``). The plan is fixed (every shape field given), so the planner's search
is not what is timed. Plan kinds:

* ``dp``: N replicas of one stage;
* ``pp``: one pipeline of N stages (GPipe, 4 microbatches; a model of N cells), only up to 64;
* ``both``: 4 stages (1F1B, 4 microbatches) times N/4 replicas.

Per configuration it reports: the seconds until every worker's card was registered (``up``), the plan
and the placement (``place``: every stage assigned and its program loaded); over ``--steps`` steps after
``--warmup``: the coordinator's main-thread CPU per step and per reply (and replies per CPU second: the
events it handles), the event loop's wake-ups per step, the ``run_step`` requests per stage and step
(under 1 where a request carries a window of steps: ``--steps-per-request``), the whole process's CPU
per step (the registry it serves and the watch included), the wall time per step, the registry writes
(revision) and the watch events the coordinator's loop saw per step, the registry keys of the job, the
coordinator's memory per worker (its RSS growth from before the fleet started, over N) and its growth
per step and worker over the timed steps (what the run's records keep), the main thread's CPU in the
cyclic collector per step; then
(``--lost``) the seconds from crashing one worker (as ``kill -9``: its lease lapses) until the session
stops with the failure.

    python bench/hollow.py --workers 16 64 256 512 [--kinds dp both pp] [--registry embedded etcd]
                           [--steps 10] [--warmup 2] [--lease-ttl 15] [--lost]
                           [--action-ms 0] [--action-jitter 0] [--coalesce-ms auto 0]
                           [--steps-per-request 0 1] [--per-process 128]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import itertools
import os
import resource
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch import nn

if not __package__:  # run as `python bench/x.py`: keep bench/comm.py from shadowing the comm package
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

__all__ = ["chain", "mse", "samples"]

WIDTH = 16
ME = "bench.hollow"
FACTORIES = [f"{ME}:chain", f"{ME}:samples", f"{ME}:mse"]
HOLLOW_MEMORY = 1 << 30  # the budget the planner is told each hollow worker has


# -- the model the hollow workers stand in for (the coordinator traces it; each hollow stage builds its
#    stage once per fleet for its tensors' names and shapes) ----------------------------------------------


def chain(cells: int = 8, width: int = WIDTH) -> list[nn.Module]:
    """``cells`` cells of Linear+Tanh: a pipeline of up to ``cells`` stages."""
    return [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(cells)]


def samples(num_samples: int = 1 << 14, width: int = WIDTH) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(num_samples, width, generator=generator),
            torch.randn(num_samples, width, generator=generator))


def mse() -> nn.Module:
    return nn.MSELoss()


def plan_fields(kind: str, workers: int) -> dict[str, Any]:
    """The fixed plan of ``kind`` on ``workers`` workers (every shape field given)."""
    if kind == "dp":
        return {"data_parallel": workers, "num_stages": 1, "num_microbatches": 1, "schedule": "gpipe"}
    if kind == "pp":
        return {"data_parallel": 1, "num_stages": workers, "num_microbatches": 4, "schedule": "gpipe"}
    if kind == "both":
        if workers % 4:
            raise ValueError(f"plan kind both takes a multiple of 4 workers, not {workers}")
        return {"data_parallel": workers // 4, "num_stages": 4, "num_microbatches": 4, "schedule": "1f1b"}
    raise ValueError(f"unknown plan kind {kind!r}: dp, pp or both")


def make_job(kind: str, workers: int, name: str, *, step_timeout_s: float = 120, steps_per_request: int = 0,
             detail_replies: int | None = None) -> Any:
    """A job of the fixed plan ``kind`` on ``workers`` hollow workers (a 4-sample microbatch);
    ``steps_per_request``: ``runtime.steps_per_request`` (0: windows of about a second of steps)."""
    from coordinator.planning.resources import Resources
    from coordinator.runtime.job import Job

    fields = plan_fields(kind, workers)
    cells = max(8, fields["num_stages"])
    batch = fields["data_parallel"] * fields["num_microbatches"] * 4
    return Job(model=f"{ME}:chain", model_kwargs={"cells": cells}, data=f"{ME}:samples",
               data_kwargs={"num_samples": max(1 << 12, batch)}, loss=f"{ME}:mse", optimizer="SGD",
               optimizer_kwargs={"lr": 0.01}, global_batch=batch, seed=1, mode="collective",
               # a hollow worker holds no tensors: the plan (fixed) must not depend on this machine's memory
               # shared by N (at 512 the memory model's fixed part no longer fits 0.8 x 23 GiB / 512)
               resources=Resources.local(workers=workers, memory_bytes=HOLLOW_MEMORY),
               step_timeout_s=step_timeout_s, max_restarts=0, steps_per_request=steps_per_request,
               name=name, **fields, **({} if detail_replies is None else {"detail_replies": detail_replies}))


# -- measuring ------------------------------------------------------------------------------------------


def rss_bytes() -> int:
    """This process's resident set (``VmRSS``)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class CollectorClock:
    """The main thread's CPU time inside the cyclic collector's passes, while installed."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._start = 0.0
        self._main = threading.main_thread()

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if threading.current_thread() is not self._main:
            return
        if phase == "start":
            self._start = time.thread_time()
        else:
            self.seconds += time.thread_time() - self._start

    def __enter__(self) -> CollectorClock:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


def process_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@dataclass
class Figures:
    workers: int
    kind: str
    registry: str
    up_s: float = 0.0
    plan_s: float = 0.0
    place_s: float = 0.0
    steps: int = 0
    wall_per_step_s: float = 0.0
    main_cpu_per_step_s: float = 0.0
    process_cpu_per_step_s: float = 0.0
    replies_per_step: int = 0
    wakeups_per_step: float = 0.0
    writes_per_step: float = 0.0
    watch_events_per_step: float = 0.0
    keys: int = 0
    rss_per_worker_bytes: float = 0.0
    rss_per_step_worker_bytes: float = 0.0  # RSS growth over the timed steps, per step and worker
    gc_per_step_s: float = 0.0  # the main thread's CPU in the cyclic collector, per timed step
    fleet_rss_per_worker_bytes: float = 0.0
    lost_s: float | None = None
    coalesce_ms: float = 0.0
    steps_per_request: int = 0  # asked (0: auto)
    requests_per_step: float = 0.0  # run_step requests the coordinator sent, per stage and step

    @property
    def cpu_per_reply_us(self) -> float:
        return self.main_cpu_per_step_s / max(1, self.replies_per_step) * 1e6

    @property
    def replies_per_cpu_s(self) -> float:
        return self.replies_per_step / self.main_cpu_per_step_s if self.main_cpu_per_step_s else 0.0


def fleet_rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@contextlib.contextmanager
def registry_url(kind: str) -> Iterator[str | None]:
    """None (the embedded registry) or the URL of an etcd started for the run."""
    if kind == "embedded":
        yield None
        return
    from tests.harness.etcd import EtcdServer

    with EtcdServer() as etcd:
        yield etcd.url


def measure(workers: int, kind: str, registry: str, *, steps: int, warmup: int, lease_ttl: float,
            lost: bool, action_ms: float = 0.0, action_jitter: float = 0.0,
            coalesce_ms: float | None = None, steps_per_request: int = 0, per_process: int | None = None,
            profile: str | None = None, detail_replies: int | None = None) -> Figures:
    from coordinator.runtime.errors import JobFailed
    from services.host.hollow_pool import HollowPool

    figures = Figures(workers, kind, registry, steps_per_request=steps_per_request)
    job_name = f"hollow-{kind}-{workers}-{registry}"
    base_rss = rss_bytes()
    with registry_url(registry) as url, HollowPool(workers, job_name, registry=url, factories=FACTORIES,
                                                   lease_ttl=timedelta(seconds=lease_ttl),
                                                   action_ms=action_ms, action_jitter=action_jitter,
                                                   **({} if per_process is None else
                                                      {"per_process": per_process})) as pool:
        figures.up_s = pool.up_seconds
        job = make_job(kind, workers, job_name, steps_per_request=steps_per_request,
                       detail_replies=detail_replies)
        started = time.monotonic()
        job.plan()
        figures.plan_s = time.monotonic() - started
        started = time.monotonic()
        with job.attach(pool):
            figures.place_s = time.monotonic() - started
            session = job._session
            assert session is not None and session.loop is not None
            loop = session.loop
            if coalesce_ms is not None:
                loop.coalesce = timedelta(milliseconds=coalesce_ms)
            figures.coalesce_ms = loop.coalesce.total_seconds() * 1e3
            seen = [0]
            track = loop._track

            def counted(event: Any) -> Any:
                seen[0] += 1
                return track(event)

            loop._track = counted  # type: ignore[method-assign]
            job.fit(warmup)
            revision, events, wakeups = pool.registry.revision(), seen[0], loop.wakeups
            requests = loop.requests["run_step"]
            cpu, main, wall, held = process_cpu(), time.thread_time(), time.monotonic(), rss_bytes()
            profiler = cProfile.Profile() if profile else None
            if profiler is not None:
                profiler.enable()
            with CollectorClock() as collector:
                result = job.fit(steps)
            if profiler is not None:
                profiler.disable()
                profiler.dump_stats(f"{profile}.{workers}-{kind}")
            figures.rss_per_step_worker_bytes = (rss_bytes() - held) / (steps * workers)
            figures.gc_per_step_s = collector.seconds / steps
            figures.wall_per_step_s = (time.monotonic() - wall) / steps
            figures.main_cpu_per_step_s = (time.thread_time() - main) / steps
            figures.process_cpu_per_step_s = (process_cpu() - cpu) / steps
            figures.writes_per_step = (pool.registry.revision() - revision) / steps
            figures.watch_events_per_step = (seen[0] - events) / steps
            figures.wakeups_per_step = (loop.wakeups - wakeups) / steps
            figures.replies_per_step = len(result.steps[-1].replies)
            figures.requests_per_step = ((loop.requests["run_step"] - requests)
                                         / (steps * max(1, figures.replies_per_step)))
            figures.steps = steps
            assert all(len(r.replies) == figures.replies_per_step for r in result.steps if r.detailed)
            figures.keys = len(pool.registry.list(f"/cellmesh/{job_name}/"))
            figures.rss_per_worker_bytes = (rss_bytes() - base_rss) / workers
            figures.fleet_rss_per_worker_bytes = sum(map(fleet_rss, pool.pids)) / workers
            if lost:
                victim = pool.names[workers // 2]
                crashed: list[float] = []
                threading.Timer(0.5, lambda: crashed.append(pool.crash(victim))).start()
                try:
                    job.fit(10_000)
                except JobFailed as exc:
                    stopped = time.time()
                    if exc.worker != victim or not crashed:
                        raise
                    figures.lost_s = stopped - crashed[0]
                else:
                    raise AssertionError("the session trained on after a worker was lost")
    return figures


def table(rows: list[Figures]) -> str:
    head = ("| workers | plan | hold ms | steps/request asked | requests/step | registry | up s | plan s "
            "| place s | step wall ms "
            "| coord. CPU ms/step "
            "| µs/reply | replies/CPU-s | wake-ups/step | process CPU ms/step | writes/step | watch ev./step "
            "| keys "
            "| coord. KiB/worker | coord. B/step/worker | GC ms/step | fleet MiB/worker | lost → stop s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for f in rows:
        lost = f"{f.lost_s:.2f}" if f.lost_s is not None else "—"
        lines.append(
            f"| {f.workers} | {f.kind} | {f.coalesce_ms:g} | {f.steps_per_request or 'auto'} "
            f"| {f.requests_per_step:.2f} | {f.registry} | {f.up_s:.1f} | {f.plan_s:.1f} "
            f"| {f.place_s:.1f} "
            f"| {f.wall_per_step_s * 1e3:.0f} | {f.main_cpu_per_step_s * 1e3:.1f} | {f.cpu_per_reply_us:.0f} "
            f"| {f.replies_per_cpu_s:,.0f} | {f.wakeups_per_step:.1f} | {f.process_cpu_per_step_s * 1e3:.1f} "
            f"| {f.writes_per_step:.1f} "
            f"| {f.watch_events_per_step:.1f} | {f.keys} | {f.rss_per_worker_bytes / 1024:.0f} "
            f"| {f.rss_per_step_worker_bytes:.0f} | {f.gc_per_step_s * 1e3:.2f} "
            f"| {f.fleet_rss_per_worker_bytes / 2**20:.2f} | {lost} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[16, 64, 256, 512])
    parser.add_argument("--kinds", nargs="+", default=["dp", "both", "pp"], choices=["dp", "pp", "both"])
    parser.add_argument("--registry", nargs="+", default=["embedded"], choices=["embedded", "etcd"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--lease-ttl", type=float, default=15.0,
                        help="the hollow workers' leases (many share one process: see docs/benchmarks.md)")
    parser.add_argument("--per-process", type=int, default=None,
                        help="hollow workers per fleet process (default: hollow_pool.PER_PROCESS)")
    parser.add_argument("--lost", action="store_true", help="then crash one worker and time the stop")
    parser.add_argument("--action-ms", type=float, default=0.0, help="how long a hollow forward takes")
    parser.add_argument("--action-jitter", type=float, default=0.0,
                        help="each compute action lasts up to this fraction longer, at random (stragglers)")
    parser.add_argument("--max-pp", type=int, default=64, help="the longest pipeline of plan kind pp")
    parser.add_argument("--coalesce-ms", nargs="+", default=["auto"],
                        help="the event loop's longest hold while replies gather (auto: the loop's own; 0: "
                             "none); several: each in turn")
    parser.add_argument("--steps-per-request", type=int, nargs="+", default=[0],
                        help="runtime.steps_per_request (0: windows of about a second); several: each "
                             "in turn")
    parser.add_argument("--detail-replies", type=int, default=None,
                        help="runtime.detail_replies: the replies whose detail the records keep "
                             "(default: the job's)")
    parser.add_argument("--profile", metavar="PREFIX",
                        help="cProfile the timed steps of each configuration into PREFIX.<workers>-<kind>")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    rows = []
    for registry in args.registry:
        for workers in args.workers:
            for kind in args.kinds:
                if kind == "pp" and workers > args.max_pp:
                    continue
                for hold, per_request in itertools.product(args.coalesce_ms, args.steps_per_request):
                    coalesce = None if hold == "auto" else float(hold)
                    figures = measure(workers, kind, registry, steps=args.steps, warmup=args.warmup,
                                      lease_ttl=args.lease_ttl, lost=args.lost, action_ms=args.action_ms,
                                      action_jitter=args.action_jitter, coalesce_ms=coalesce,
                                      steps_per_request=per_request, per_process=args.per_process,
                                      profile=args.profile, detail_replies=args.detail_replies)
                    rows.append(figures)
                    # progress on stderr, as each finishes; the table (stdout) once at the end
                    print(table([figures]).splitlines()[-1], file=sys.stderr, flush=True)
    print(f"\nload average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(table(rows))


if __name__ == "__main__":
    main()
