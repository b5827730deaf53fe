"""Bad jobs as a new user tries them: ``cellmesh run`` ends in one line on stderr, exit 2, and loses nothing.

One test per mistake (the factories are ``bad_models.py``'s). Each run is the real command in
a subprocess, with ``--run-dir`` and ``-o`` over an earlier good output. A job refused by its
checks (``Job.check``) must be refused before any worker starts, within seconds: nothing on
stdout, no run directory, the earlier output byte-identical. A loss that becomes NaN stops
the run at that step with the output untouched too. A global batch the planner could not
spread over every worker is not an error: one warning line, and the run trains.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.multiproc.coordinator.test_run import ROOT, Proc, assert_user_error, cellmesh

pytestmark = pytest.mark.timeout(90)

M = "tests.multiproc.coordinator.models"
B = "tests.multiproc.coordinator.bad_models"
GOOD = {"version": 2, "steps": 3, "model": {"factory": f"{M}:mlp"},
        "data": {"factory": f"{M}:regression", "global_batch": 16, "seed": 1},
        "loss": {"factory": f"{M}:mse"}, "optimizer": {"name": "SGD", "kwargs": {"lr": 0.1}}}
REFUSED_WITHIN_S = 45  # loosely: a check takes a few seconds (importing torch is most of it)


def job_file(tmp_path: Path, **sections: Any) -> Path:
    """``GOOD`` with ``sections`` replaced (a section given as a dict updates the good one)."""
    spec = {**GOOD, **{k: {**GOOD[k], **v} if isinstance(v, dict) and isinstance(GOOD.get(k), dict) else v
                       for k, v in sections.items()}}
    path = tmp_path / "job.json"
    path.write_text(json.dumps(spec))
    return path


class Outputs:
    """The run's ``--run-dir`` and ``-o``, the latter holding an earlier good model."""

    def __init__(self, tmp_path: Path) -> None:
        self.run_dir = tmp_path / "run"
        self.output = tmp_path / "out" / "model.pt"
        self.output.parent.mkdir(parents=True)
        torch.save({"weight": torch.arange(6.0)}, self.output)
        self.earlier = self.output.read_bytes()

    @property
    def args(self) -> list[str | Path]:
        return ["--run-dir", self.run_dir, "-o", self.output]

    def untouched(self) -> None:
        assert self.output.read_bytes() == self.earlier, "the earlier output was overwritten"
        assert sorted(p.name for p in self.output.parent.iterdir()) == ["model.pt"]  # no temporary left
        assert not (self.run_dir / "model.pt").exists()


def refused(tmp_path: Path, job: Path, *args: str, needles: tuple[str, ...]) -> str:
    """Run ``job`` and check it was refused by its checks: one line, exit 2, fast, nothing written."""
    outputs = Outputs(tmp_path)
    started = time.monotonic()
    proc = cellmesh("run", job, *args, *outputs.args, timeout=60)
    assert time.monotonic() - started < REFUSED_WITHIN_S, proc.stderr
    assert_user_error(proc, *needles)
    assert proc.stdout == "", proc.stdout  # refused before the run directory and the plan were printed
    assert not outputs.run_dir.exists()
    outputs.untouched()
    return proc.stderr


def test_a_model_factory_that_raises(tmp_path: Path) -> None:
    refused(tmp_path, job_file(tmp_path, model={"factory": f"{B}:raising"}), needles=(
        f"model factory '{B}:raising' raised RuntimeError: the width must be even (at ",
        "bad_models.py:", "fix the factory or model.kwargs"))


def test_cells_that_do_not_fit_the_data_or_each_other(tmp_path: Path) -> None:
    refused(tmp_path, job_file(tmp_path, model={"factory": f"{B}:misfit"}), needles=(
        f"model factory '{B}:misfit': cell 'cell2' (Linear(in_features=14, out_features=3",
        "fails on the output of cell 'cell1', [8, 12] float64", "mat1 and mat2 shapes cannot be multiplied"))


def test_inputs_and_targets_of_different_lengths(tmp_path: Path) -> None:
    refused(tmp_path, job_file(tmp_path, data={"factory": f"{B}:uneven"}), needles=(
        f"data factory '{B}:uneven' returns 256 inputs but 200 targets", "give them the same length"))


def test_a_fixed_replica_count_the_batch_does_not_split_into(tmp_path: Path) -> None:
    job = job_file(tmp_path, data={"global_batch": 33})
    refused(tmp_path / "fixed", job, "--workers", "2", "--data-parallel", "2", needles=(
        "global_batch=33 does not split evenly into data_parallel=2 replicas", "a multiple of 2 (32 or 34)"))
    refused(tmp_path / "strategy", job, "--workers", "2", "--strategy", "data_parallel", needles=(
        "strategy='data_parallel' on 2 workers", "global_batch=33 splits into none of 2..2"))


def test_a_batch_the_planner_cannot_spread_is_one_warning_and_the_run_trains(tmp_path: Path) -> None:
    # one cell: the only way to use the second worker is a second replica, which 33 samples do not allow
    job = job_file(tmp_path, model={"factory": f"{B}:one_linear"}, data={"global_batch": 33}, steps=2)
    outputs = Outputs(tmp_path)
    proc = cellmesh("run", job, "--workers", "2", *outputs.args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and " WARNING " in lines[0], proc.stderr
    note = ("global_batch=33 does not split evenly into 2 replicas, so the plan uses 1 of the 2 workers (1 "
            "replica(s) x 1 stage(s)); a global batch that is a multiple of 2 (32 or 34) lets the planner "
            "use 2")
    assert lines[0].endswith(note), lines[0]
    assert "plan: 1 replica(s) x 1 stage(s)" in proc.stdout and "step 2/2" in proc.stdout
    assert torch.load(outputs.output, weights_only=True).keys() == {"weight", "bias"}


def test_an_output_path_that_cannot_be_written(tmp_path: Path) -> None:
    job = job_file(tmp_path)
    for path, says in [
            ("/proc/cellmesh-test.pt", "cannot write the state_dict to /proc/cellmesh-test.pt"),
            ("/proc/cellmesh-test/model.pt", "cannot create the output directory /proc/cellmesh-test")]:
        started = time.monotonic()
        proc = cellmesh("run", job, "--run-dir", tmp_path / "run", "-o", path, timeout=60)
        assert time.monotonic() - started < REFUSED_WITHIN_S
        assert_user_error(proc, says, "give an output path (-o) in a directory you can write")
        assert proc.stdout == "" and not (tmp_path / "run").exists()


def test_a_model_too_big_for_any_plan_is_refused_in_seconds_without_its_memory(tmp_path: Path) -> None:
    job = job_file(tmp_path, model={"factory": f"{B}:huge"}, data={"factory": f"{B}:huge_data"},
                   optimizer={"name": "Adam", "kwargs": {"lr": 0.001}})
    outputs = Outputs(tmp_path)
    script = Path(sys.executable).with_name("cellmesh")
    cmd = [str(script)] if script.is_file() else [sys.executable, "-m", "coordinator.commands.cli"]
    started = time.monotonic()
    child = subprocess.Popen([*cmd, "run", str(job), "--workers", "2", *map(str, outputs.args)], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = child.stdout.read(), child.stderr.read()  # type: ignore[union-attr]  # both piped
    _, status, usage = os.wait4(child.pid, 0)  # this child's own peak memory
    child.returncode = os.waitstatus_to_exitcode(status)
    assert time.monotonic() - started < REFUSED_WITHIN_S, stderr
    proc: Proc = subprocess.CompletedProcess(child.args, child.returncode, stdout, stderr)
    assert_user_error(proc, "no plan: the model is too big for these workers: its 160B parameters (596 GiB)",
                      "adam optimizer state (1.16 TiB) need at least 1.16 TiB on one worker",
                      "give the workers more memory, add workers")
    # 160B parameters would be 596 GiB; the check builds them on the meta device
    assert usage.ru_maxrss * 1024 < 2 * 2**30, f"peak memory {usage.ru_maxrss} KiB"
    assert stdout == "" and not outputs.run_dir.exists()
    outputs.untouched()


@pytest.mark.parametrize(("model", "flags", "needles"), [
    ("plain", ["--workers", "3", "--stages", "3"], (
        f"model factory '{B}:plain' returns a Plain that torch.fx traces into 2 node(s) (a, b)",
        "plan.num_stages=3", "at most 2 stage(s)", "cellmesh.Cell(name, module)")),
    ("gated", ["--workers", "2"], (
        f"model factory '{B}:gated': torch.fx cannot trace submodule 'gate' (Gate)",
        "list it in model.leaves", "cellmesh.Cell")),
])
def test_a_plain_module_that_cannot_be_cut_as_asked(tmp_path: Path, model: str, flags: list[str],
                                                    needles: tuple[str, ...]) -> None:
    refused(tmp_path, job_file(tmp_path, model={"factory": f"{B}:{model}"}), *flags, needles=needles)


def test_a_loss_that_becomes_nan_stops_at_its_step_and_writes_nothing(tmp_path: Path) -> None:
    # NaN in sample 20: without shuffling, step 2's batch (samples 16..31)
    job = job_file(tmp_path, data={"factory": f"{B}:nan_at", "kwargs": {"indices": [20]}, "shuffle": False},
                   steps=4)
    outputs = Outputs(tmp_path)
    proc = cellmesh("run", job, "--workers", "2", "--stages", "2", *outputs.args)
    assert_user_error(proc, "step 2: the loss of microbatch ",
                      " is nan on stage 1 (worker local-1, replica 0); the job stopped before applying it "
                      "(the last good loss was ", " at step 1)", "runtime.nonfinite: skip")
    assert "step 1/4" in proc.stdout and "step 2/4" not in proc.stdout
    outputs.untouched()
    record = json.loads((outputs.run_dir / "run.json").read_text())
    assert record["phase"] == "failed" and record["step"] == 1 and "step 2: the loss" in record["error"]
