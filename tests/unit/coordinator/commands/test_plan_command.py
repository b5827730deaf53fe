"""``cellmesh plan``: the plan and its predicted step printed, the timeline drawn, no worker started.

Covers coordinator/commands/plan.py and the matplotlib path of draw_timeline
(coordinator/planning/timeline_plot.py); the PNG test is skipped when matplotlib (the
``plot`` extra) is not installed.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from xml.etree import ElementTree

import pytest

from coordinator.commands import cli
from coordinator.planning.schedules import build_schedule

M = "tests.multiproc.coordinator.models"
SPEC = {"version": 2, "model": {"factory": f"{M}:mlp"},
        "data": {"factory": f"{M}:regression", "global_batch": 16}, "loss": {"factory": f"{M}:mse"},
        "optimizer": {"name": "SGD", "kwargs": {"lr": 0.1}}}
ARGS = ["--workers", "2", "--stages", "2", "--microbatches", "4", "--schedule", "1f1b"]


@pytest.fixture
def spec(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(SPEC))
    return path


def test_plan_prints_the_plan_and_draws_every_predicted_action(spec: Path, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    svg = tmp_path / "timeline.svg"
    assert cli.main(["plan", str(spec), *ARGS, "--timeline", str(svg)]) == 0
    out = capsys.readouterr().out
    assert "plan: 1 replica(s) x 2 stage(s) = 2 worker(s), 1f1b, 4 microbatches" in out
    assert "1f1b: step " in out and f"predicted timeline written to {svg}" in out
    # 4 microbatches of 4 samples, profiled on 8: priced again on 4 ([Note: the plan's own size])
    assert "priced on timings at its own microbatch size (4 samples); the search weighed it at " in out
    titles = [t.text or "" for t in ElementTree.parse(svg).iter("{http://www.w3.org/2000/svg}title")]
    drawn = sorted(t.split()[0] for t in titles)  # one box per action, titled with its printed name
    assert drawn == sorted(str(a) for acts in build_schedule("1f1b", 2, 4).actions for a in acts)
    assert not (tmp_path / "out").exists()  # no run directory: nothing ran


def test_a_png_timeline_without_matplotlib_names_the_extra_before_planning(
        spec: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    assert cli.main(["plan", str(spec), *ARGS, "--timeline", str(tmp_path / "t.png")]) == 2
    captured = capsys.readouterr()
    assert "pip install 'cellmesh[plot]'" in captured.err
    assert "plan:" not in captured.out  # refused before the profiling


def test_plan_draws_a_png_with_matplotlib(spec: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the PNG timeline needs the optional extra cellmesh[plot]")
    png = tmp_path / "timeline.png"
    assert cli.main(["plan", str(spec), *ARGS, "--timeline", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _stage_rows(out: str) -> list[list[str]]:
    """Each stage row's workers, from the plan's table (its last column, comma-separated)."""
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("stage  nodes"))
    rows = []
    for line in lines[head + 1:]:
        if not line.strip() or not line.split()[0].isdigit():
            break
        rows.append(line.split(" cpu ")[1].strip().split(", "))
    return rows


def test_plan_dry_runs_a_two_host_resource_file(spec: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """2 hosts x 4 workers with a slow network between them: 2 replicas x 2 stages fit in one host, and the
    runners-up are printed; no worker starts."""
    resources = tmp_path / "cluster.yaml"
    resources.write_text("hosts: [{name: node, count: 2, workers: 4, memory: 1GiB}]\n"
                         "inter_host: {bandwidth_bps: 1.25e8, latency_s: 2e-4}\n")
    args = ["--data-parallel", "2", "--stages", "2", "--schedule", "1f1b", "--runners-up", "3"]
    assert cli.main(["plan", str(spec), "--resources", str(resources), *args]) == 0
    out = capsys.readouterr().out
    assert out.startswith("resources: 8 workers (8 cpu) on 2 host(s) (2 of 4); links 3.5 GB/s, 100 us "
                          "inside a host, 0.125 GB/s, 200 us between hosts\n")
    assert "plan: 2 replica(s) x 2 stage(s) = 4 worker(s), 1f1b" in out
    rows = _stage_rows(out)
    assert len(rows) == 2 and sorted(w for row in rows for w in row) == [f"node-0-{i}" for i in range(4)]
    runners = out.split("runners-up (the 3 fastest plans weighed, fitting ones first):\n")[1].splitlines()
    assert runners[0].split()[:4] == ["d", "p", "mode", "sched"] and len(runners) == 4
    assert all(r.split()[:2] == ["2", "2"] for r in runners[1:])  # the fixed shape
    assert not (tmp_path / "out").exists()


def test_plan_dry_runs_256_workers(spec: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    resources = tmp_path / "cluster.json"
    resources.write_text(json.dumps({"hosts": [{"name": "n", "count": 32, "workers": 8, "memory": "1GiB"}]}))
    args = ["--set", "data.global_batch=256", "--set", "data.kwargs.num_samples=256", "--data-parallel", "64",
            "--stages", "4", "--runners-up", "0"]  # 256 samples: a job of fewer than one batch is refused
    assert cli.main(["plan", str(spec), "--resources", str(resources), *args]) == 0
    out = capsys.readouterr().out
    assert "resources: 256 workers (256 cpu) on 32 host(s) (32 of 8)" in out
    assert "plan: 64 replica(s) x 4 stage(s) = 256 worker(s)" in out and "runners-up" not in out
    assert re.search(r"the planner's search took \d+\.\d\d s\n", out)  # its stage count set: no hint
    rows = _stage_rows(out)
    assert len({w for row in rows for w in row}) == 256 and all(len(row) == 64 for row in rows)


def test_plan_names_a_bad_resource_file_before_profiling(spec: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    resources = tmp_path / "cluster.yaml"
    resources.write_text("hosts: [{name: node, workers: 4}]\n")
    assert cli.main(["plan", str(spec), "--resources", str(resources)]) == 2
    captured = capsys.readouterr()
    assert f"resource file {resources} is invalid: hosts.0.memory: Field required" in captured.err
    assert "plan:" not in captured.out


def test_plan_notes_hosts_whose_workers_want_more_threads_than_cores(
        spec: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A host entry's ``cores``: 3 hosts whose 4 workers want 2 threads each of 4 cores are noted once under
    the resources line (the first, and how many more); the plan is still made."""
    resources = tmp_path / "cluster.yaml"
    resources.write_text("hosts: [{name: node, count: 3, workers: 4, cpus: 2, cores: 4, memory: 1GiB}]\n")
    args = ["--data-parallel", "2", "--stages", "2", "--runners-up", "0"]
    assert cli.main(["plan", str(spec), "--resources", str(resources), *args]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("resources: 12 workers (12 cpu) on 3 host(s)")
    assert lines[1] == ("note: the CPU workers of node-0 (4 wanting 8 threads of its 4 cores) and 2 more "
                        "take turns on their cores; the plans are priced so, and fewer workers per host or "
                        "fewer threads each (a worker's cpus) run each one faster")
    assert any(line.startswith("plan: 2 replica(s) x 2 stage(s)") for line in lines)
