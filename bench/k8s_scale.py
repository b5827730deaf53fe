"""Kubernetes at size: the render of 2 to 1,024 workers, and the registry footprint of a worker.

Two measurements (``python -m bench.k8s_scale``; ``--skip-registry`` for the first alone):

* render: ``cellmesh k8s render`` of ``examples/charlm.yaml`` for each worker count, written,
  linted (``coordinator/commands/k8s/lint.py``), validated against the strict schemas
  (``kubernetes-validate --strict``, one process for all the manifests) and built with
  ``kubectl kustomize`` when kubectl is installed, as the tests do; the time of each part
  (median of ``--repeats``), the objects by kind and the largest object's bytes (what the
  Kubernetes API server's etcd stores per object; its request limit is 1.5 MiB).
* registry: a local run of the tests' MLP (``tests/multiproc/coordinator/models.py``) on 2 and
  4 workers with the embedded registry, data parallel (collective) and a 2-stage pipeline per
  replica: after the third step, the keys under ``/cellmesh/``, the live leases, the watches
  (distinct client connection and prefix among the long polls served) and the largest value,
  and over the next steps the registry writes (revisions) and watch polls served per step.
  The leases are read off the in-process ``MemoryRegistry`` (its private table) and the polls
  counted by wrapping the registry service's handler: a benchmark's view, not an API.
  Keep-alives are not writes: each lease is refreshed every third of its TTL
  (``comm/registry/keepalive.py``).

Timings are wall-clock on a shared machine; say so next to them.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
CHARLM = REPO / "examples" / "charlm.yaml"
VALIDATE = Path(sys.executable).with_name("kubernetes-validate")
M = "tests.multiproc.coordinator.models"


def render_once(workers: int) -> dict[str, Any]:
    from coordinator.commands.k8s.lint import Expect, lint
    from coordinator.commands.k8s.options import RenderOptions
    from coordinator.commands.k8s.render import render
    from coordinator.commands.k8s.writer import write

    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        files = render(RenderOptions(job=CHARLM, workers=workers))
        paths = write(files, Path(tmp), None)
        out["render_s"] = time.perf_counter() - start
        objects = [o for objs in files.values() for o in objs]
        start = time.perf_counter()
        problems = lint(objects, Expect(workers=workers, gpus_per_worker=0))
        out["lint_s"] = time.perf_counter() - start
        assert problems == [], problems
        start = time.perf_counter()
        manifests = [str(p) for p in paths if p.parent.name == "manifests"]
        result = subprocess.run([str(VALIDATE), "--strict", *manifests], capture_output=True, text=True,
                                timeout=300)
        out["validate_s"] = time.perf_counter() - start
        assert result.returncode == 0 and "WARN" not in result.stdout + result.stderr, result.stdout
        kubectl = shutil.which("kubectl")
        if kubectl is not None:
            start = time.perf_counter()
            built = subprocess.run([kubectl, "kustomize", tmp], capture_output=True, text=True, timeout=300)
            out["kustomize_s"] = time.perf_counter() - start
            assert built.returncode == 0, built.stderr
        out["kinds"] = Counter(o["kind"] for o in objects)
        out["largest"] = max((len(yaml.safe_dump(o)), o["kind"]) for o in objects)
        replicas = [o["spec"]["replicas"] for o in objects if o["kind"] == "StatefulSet"]
        out["replicas"] = replicas
    return out


def bench_render(counts: list[int], repeats: int) -> None:
    render_once(2)  # imports and schema caches warm
    print(f"# cellmesh k8s render of examples/charlm.yaml, median of {repeats} (wall clock, shared machine)")
    print(f"{'workers':>8} {'render+write s':>15} {'lint s':>8} {'validate s':>11} {'kustomize s':>12} "
          f"{'total s':>8} {'objects':>8} {'largest object':>22}  StatefulSet replicas")
    for n in counts:
        runs = [render_once(n) for _ in range(repeats)]
        med = {k: statistics.median(r[k] for r in runs) for k in ("render_s", "lint_s", "validate_s")}
        kust = statistics.median(r.get("kustomize_s", 0.0) for r in runs)
        total = sum(med.values()) + kust
        last = runs[-1]
        size, kind = last["largest"]
        largest, objects = f"{size} B ({kind})", sum(last["kinds"].values())
        print(f"{n:>8} {med['render_s']:>15.3f} {med['lint_s']:>8.3f} {med['validate_s']:>11.2f} "
              f"{kust:>12.2f} {total:>8.2f} {objects:>8} {largest:>22}  {last['replicas']}")
    print("kinds:", dict(sorted(render_once(counts[-1])["kinds"].items())))


def registry_footprint(workers: int, data_parallel: int, stages: int, steps: int = 6) -> dict[str, float]:
    from comm.registry.server import RegistryService
    from coordinator.runtime.job import Job
    from coordinator.runtime.records import StepRecord

    job = Job(model=f"{M}:mlp", data=f"{M}:regression", loss=f"{M}:mse", optimizer="SGD",
              optimizer_kwargs={"lr": 0.1}, global_batch=16, workers=workers, data_parallel=data_parallel,
              num_stages=stages, num_microbatches=2, schedule="1f1b", code_dir=str(REPO), step_timeout_s=120)
    seen: dict[str, float] = {}
    revisions: list[int] = []
    polled: list[int] = []
    polls: list[tuple[bytes, str]] = []  # every watch poll served: (the client connection, its prefix)
    original = RegistryService.rpc_watch_poll

    @functools.wraps(original)  # the service host reads the handler's type hints
    def counted(self: Any, request: Any, call: Any) -> Any:
        polls.append((call.peer.identity, request.prefix))
        return original(self, request, call)

    def callback(record: StepRecord) -> None:
        harness = job.harness
        assert harness is not None
        registry: Any = harness.registry
        revisions.append(registry.revision())
        polled.append(len(polls))
        if len(revisions) == 3:
            items = registry.list("/cellmesh/")
            seen["keys"] = len(items)
            seen["largest_value"] = max(len(kv.value) for kv in items)
            seen["leases"] = len(registry._leases)  # the benchmark's view of the in-process registry
            seen["watches"] = len(set(polls))  # a remote watch is a chain of long polls on one prefix

    RegistryService.rpc_watch_poll = counted  # type: ignore[method-assign]
    try:
        with job:
            job.fit(steps, callback=callback)
    finally:
        RegistryService.rpc_watch_poll = original  # type: ignore[method-assign]
    seen["writes_per_step"] = (revisions[-1] - revisions[2]) / (len(revisions) - 3)
    seen["polls_per_step"] = (polled[-1] - polled[2]) / (len(polled) - 3)
    return seen


def bench_registry() -> None:
    print("\n# registry footprint of a local run (embedded registry), after step 3")
    print(f"{'workers':>8} {'plan':>10} {'keys':>6} {'leases':>7} {'watches':>8} {'largest value B':>16} "
          f"{'writes/step':>12} {'watch polls/step':>17}")
    for workers, d, p in ((2, 2, 1), (4, 4, 1), (2, 1, 2), (4, 2, 2)):
        got = registry_footprint(workers, d, p)
        plan = f"{d}x{p}"
        print(f"{workers:>8} {plan:>10} {got['keys']:>6.0f} {got['leases']:>7.0f} {got['watches']:>8.0f} "
              f"{got['largest_value']:>16.0f} {got['writes_per_step']:>12.1f} {got['polls_per_step']:>17.1f}")


def _cpu_s(pid: int) -> float:
    """A process's user + system CPU seconds (``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def bench_etcd(keys: int, seconds: float, threads: int) -> None:
    """etcd (the binary on PATH) holding ``keys`` registry entries of 0.3 KiB, each under its own lease (60 s
    here, so none lapses while they are made), renewed by cellmesh's client as the workers renew theirs
    for ``seconds``; and one listing of them all."""
    from comm.registry.etcd import EtcdRegistry
    from tests.harness.etcd import EtcdServer

    with EtcdServer() as etcd, concurrent.futures.ThreadPoolExecutor(threads) as pool:
        assert etcd.pid is not None
        registry = EtcdRegistry("127.0.0.1", etcd.client_port)
        value = b"x" * 300
        start = time.perf_counter()
        leases = list(pool.map(lambda i: registry.lease(timedelta(seconds=60)), range(keys)))
        list(pool.map(lambda i: registry.put(f"/cellmesh/j/workers/w{i:05d}", value, lease=leases[i]),
                      range(keys)))
        setup = time.perf_counter() - start
        print(f"\n# etcd {etcd_version()}: {keys} keys of 300 B, each under its own lease "
              f"(wall clock, shared machine)")
        print(f"granted and put in {setup:.1f} s with {threads} client threads; "
              f"etcd RSS {_rss_mib(etcd.pid):.0f} MiB")
        cpu, done, start = _cpu_s(etcd.pid), 0, time.perf_counter()
        while time.perf_counter() - start < seconds:  # all of them, round and round
            batch = [leases[(done + i) % keys] for i in range(threads * 8)]
            done += sum(1 for _ in pool.map(lambda lease: lease.refresh(), batch))
        took = time.perf_counter() - start
        rate, busy = done / took, (_cpu_s(etcd.pid) - cpu) / took
        print(f"keep-alives: {rate:.0f}/s reached by this client, etcd busy {busy:.2f} CPU "
              f"({busy / rate * 1e3:.2f} ms CPU per keep-alive); the workers' rate at this count is "
              f"{keys / (10 / 3):.0f}/s; etcd RSS {_rss_mib(etcd.pid):.0f} MiB")
        for prefix in ("/cellmesh/j/workers/w000", "/cellmesh/j/workers/w00", "/cellmesh/j/workers/"):
            start, rounds = time.perf_counter(), 10
            for _ in range(rounds):
                listed = registry.list(prefix)
            took = (time.perf_counter() - start) / rounds
            print(f"one listing of {len(listed)} entries: {took * 1e3:.1f} ms")
        registry.close()


def etcd_version() -> str:
    out = subprocess.run(["etcd", "--version"], capture_output=True, text=True, timeout=30).stdout.split()
    return out[2] if len(out) > 2 else "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 64, 256, 1024])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-registry", action="store_true")
    parser.add_argument("--etcd-keys", type=int, default=0, metavar="N",
                        help="also measure etcd (on PATH) holding N leased entries (e.g. 3100)")
    args = parser.parse_args()
    bench_render(args.workers, args.repeats)
    if not args.skip_registry:
        bench_registry()
    if args.etcd_keys:
        bench_etcd(args.etcd_keys, seconds=10.0, threads=8)


if __name__ == "__main__":
    main()
