"""``cellmesh run`` as a user runs it: a subprocess on a job file, real workers, a state_dict on disk.

Each successful run trains the MLP of ``models.py`` for a few steps on 2 local workers
and must exit 0, print the plan table and a log line per step (stdout is a pipe, so no
bar), and write a state_dict that loads into the job's model with ``strict=True``. Bad
job files and unimportable factories must fail before any worker starts, with one
paragraph on stderr, no traceback and exit code 2; a worker's failure exits 1.
``cellmesh demo`` is the same path on ``examples/charlm.py``.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from comm.logs import LOG_FORMAT_ENV, LOG_LEVEL_ENV
from coordinator.commands.run import report
from coordinator.runtime.errors import JobFailed
from examples import charlm
from tests.harness import commands
from tests.multiproc.coordinator import models

pytestmark = pytest.mark.timeout(150)

ROOT = Path(__file__).resolve().parents[3]
M = "tests.multiproc.coordinator.models"
SPEC = {"version": 2, "steps": 3, "model": {"factory": f"{M}:mlp"},
        "data": {"factory": f"{M}:regression", "global_batch": 16, "seed": 1},
        "loss": {"factory": f"{M}:mse"}, "optimizer": {"name": "SGD", "kwargs": {"lr": 0.1}}}
RUN_TIMEOUT = 90  # seconds a successful run may take (about 8 s here; 40 on a machine loaded 5x over)
Proc = subprocess.CompletedProcess[str]


def cellmesh(*args: str | Path, timeout: float = RUN_TIMEOUT, env: dict[str, str] | None = None,
             fresh: bool = False) -> Proc:
    """The installed ``cellmesh`` command (else ``python -m coordinator.commands.cli``), run in the repo.

    ``env`` is set over this process's environment, whose cellmesh logging variables are left out.
    The command is forked from the harness's fork server ([Note: commands from a fork server] in
    ``tests/harness/commands.py``); ``fresh`` starts a new interpreter instead, as a user's shell does.
    """
    script = Path(sys.executable).with_name("cellmesh")
    cmd = [str(script)] if script.is_file() else [sys.executable, "-m", "coordinator.commands.cli"]
    base = {k: v for k, v in os.environ.items() if k not in (LOG_LEVEL_ENV, LOG_FORMAT_ENV)}
    argv = [*cmd, *map(str, args)]
    if not fresh:
        return commands.run(argv, cwd=ROOT, timeout=timeout, env={**base, **(env or {})})
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          check=False, env={**base, **(env or {})})


def assert_trained(proc: Proc, output: Path, steps: int) -> dict[str, torch.Tensor]:
    """A run that exited 0 with its progress, wrote ``output`` and the same state_dict to its run directory
    (``output``'s sibling ``run``, as the tests pass ``--run-dir``)."""
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "plan: " in out and "stage  nodes" in out and "workers (data-parallel group)" in out, out
    for k in range(1, steps + 1):
        assert f"step {k}/{steps}  loss " in out and "samples/s" in out, out
    run_dir = output.parent / "run"
    assert "done: " in out and str(output) in out and f"run directory {run_dir}" in out, out
    state: dict[str, torch.Tensor] = torch.load(output, weights_only=True)
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    in_run_dir = torch.load(run_dir / "model.pt", weights_only=True)
    assert state.keys() == in_run_dir.keys() and all(torch.equal(state[k], in_run_dir[k]) for k in state)
    return state


def load_into_mlp(state: dict[str, torch.Tensor], seed: int) -> None:
    torch.manual_seed(seed)
    model = nn.Sequential(*models.mlp())
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(state, strict=True)
    assert any(not torch.equal(initial[k], state[k]) for k in state), "the parameters did not move"


def test_json_spec_trains_and_writes_a_loadable_state_dict(tmp_path: Path) -> None:
    spec = tmp_path / "tiny.json"
    spec.write_text(json.dumps(SPEC))
    output = tmp_path / "out" / "tiny.pt"
    proc = cellmesh("run", spec, "--workers", "2", "--strategy", "data_parallel", "--output", output,
                    "--run-dir", output.parent / "run")
    state = assert_trained(proc, output, 3)
    assert "2 replica(s) x 1 stage(s)" in proc.stdout
    load_into_mlp(state, seed=1)


def test_yaml_spec_with_a_pipeline_and_settings_from_the_command_line(tmp_path: Path) -> None:
    spec = tmp_path / "tiny.yaml"
    spec.write_text(textwrap.dedent(f"""\
        # a two-stage pipeline of the MLP
        model: {{factory: {M}:mlp}}
        data: {{factory: {M}:regression, global_batch: 16, seed: 5}}
        loss: {{factory: {M}:mse}}
        optimizer: {{name: Adam, kwargs: {{lr: 0.01}}}}
        steps: 50
        plan: {{num_stages: 2}}
        """))
    output = tmp_path / "tiny.pt"
    proc = cellmesh("run", spec, "--workers", "2", "--steps", "2", "--plan.num-microbatches", "2",
                    "--set", "data.seed=2", "-o", output, "--run-dir", tmp_path / "run")
    state = assert_trained(proc, output, 2)
    assert "1 replica(s) x 2 stage(s)" in proc.stdout and "crossing tensors per microbatch" in proc.stdout
    load_into_mlp(state, seed=2)


def test_job_module_with_its_own_factories(tmp_path: Path) -> None:
    # the model comes from a module beside the job file: the coordinator and the workers find it there
    (tmp_path / "tinyparts_cli.py").write_text(textwrap.dedent("""\
        from torch import nn


        def model():
            return [nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)]
        """))
    module = tmp_path / "tinyjob_cli.py"
    module.write_text(textwrap.dedent("""\
        import torch
        from tinyparts_cli import model

        from coordinator.runtime.job import Job


        def data():
            g = torch.Generator().manual_seed(0)
            return torch.randn(32, 4, generator=g), torch.randn(32, 2, generator=g)


        def job():
            return Job(model=model, data=data, loss="torch.nn:MSELoss", optimizer="SGD",
                       optimizer_kwargs={"lr": 0.1}, global_batch=8, seed=3, steps=3)
        """))
    output = tmp_path / "tinyjob.pt"
    proc = cellmesh("run", module, "--workers", "2", "-o", output, "--run-dir", tmp_path / "run")
    state = assert_trained(proc, output, 3)
    assert "job module tinyjob_cli" in proc.stdout and "tinyparts_cli:model" in proc.stdout
    assert "tinyjob_cli:data" in proc.stdout
    torch.manual_seed(3)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    net.load_state_dict(state, strict=True)


def assert_user_error(proc: Proc, *needles: str) -> None:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = proc.stderr.strip()
    assert err.startswith("cellmesh: error: ") and "\n" not in err, err  # one paragraph
    assert "Traceback" not in proc.stdout + proc.stderr
    for needle in needles:
        assert needle in err, err


def test_a_misspelt_field_is_named(tmp_path: Path) -> None:
    spec = tmp_path / "bad.yaml"
    spec.write_text(f"model: {{factory: {M}:mlp}}\ndata: {{factory: {M}:regression, global_bach: 16}}\n"
                    f"loss: {{factory: {M}:mse}}\nplan: {{mode: ps}}\n")
    # a fresh interpreter, as a user's shell starts the console script (once in the suite: a refusal is cheap)
    assert_user_error(cellmesh("run", spec, "--workers", "2", timeout=45, fresh=True), "bad.yaml",
                      "'data.global_bach': unknown field", "'plan.mode'")


def test_a_factory_that_does_not_import_is_named(tmp_path: Path) -> None:
    spec = tmp_path / "missing.json"
    spec.write_text(json.dumps({**SPEC, "model": {"factory": "no_such_package.models:mlp"}}))
    assert_user_error(cellmesh("run", spec, "--workers", "2", timeout=45), "missing.json",
                      "model factory 'no_such_package.models:mlp'", "No module named 'no_such_package'")


def test_a_plan_that_does_not_fit_and_a_broken_module(tmp_path: Path) -> None:
    spec = tmp_path / "tiny.json"
    spec.write_text(json.dumps(SPEC))
    assert_user_error(cellmesh("run", spec, "--workers", "2", "--stages", "3", "--run-dir", tmp_path / "run",
                               timeout=45),
                      "no plan", "num_stages=3")
    module = tmp_path / "broken_job_cli.py"
    module.write_text("def job():\n    return 42\n")
    assert_user_error(cellmesh("run", module, timeout=45), "broken_job_cli", "returned 42 (int)")


def test_a_worker_failure_is_one_paragraph_and_exits_1() -> None:
    # the failure itself is test_parity.py's test_a_service_error_stops_the_job_naming_...;
    # here only what the command makes of it (a subprocess run would cost ~10 s more)
    failed = JobFailed("step 2 failed: worker local-1, service r/compute-r1-s0: [step_failed]\n  corrupt",
                       worker="local-1", service="r/compute-r1-s0", step=2)
    err = io.StringIO()
    assert report(failed, err=err) == 1
    assert err.getvalue() == ("cellmesh: error: the job failed: step 2 failed: worker local-1, service "
                              "r/compute-r1-s0: [step_failed] corrupt\n")


def test_demo_trains_the_example_language_model(tmp_path: Path) -> None:
    output = tmp_path / "charlm.pt"
    proc = cellmesh("demo", "--steps", "2", "-o", output, "--run-dir", tmp_path / "run")
    state = assert_trained(proc, output, 2)
    assert "job module charlm" in proc.stdout and "the trained model continues 'The '" in proc.stdout
    nn.Sequential(*charlm.model()).load_state_dict(state, strict=True)
