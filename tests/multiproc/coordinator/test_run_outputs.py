"""Where a local run's output goes: the run directory, worker logs, JSON lines, trace, metrics, TensorBoard.

One ``cellmesh run`` subprocess (as a user runs it) on a spec whose ``logging`` section
alone sets the run directory and JSON lines checks the run directory's files and that the
terminal shows only the run's own lines; another checks the precedence of the settings
(flag > spec > environment); one run in this process checks what the run reported against
what it wrote and served: the metrics endpoint during the run, the TensorBoard scalars and
the trace against the losses and step records of the fit, and the workers' JSON records
(at DEBUG, with the step they belong to).
"""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from comm.logs import LOG_FORMAT_ENV, LOG_LEVEL_ENV, configure_logging, current_format
from coordinator.commands.jobspec import load_job
from coordinator.commands.run import RunOptions, train
from coordinator.commands.rundir import RunRecord
from coordinator.planning.plan import Plan
from coordinator.runtime.harness import LocalHarness
from coordinator.runtime.records import StepRecord
from tests.harness.http import http_get
from tests.multiproc.coordinator.test_run import SPEC, cellmesh

pytestmark = pytest.mark.timeout(90)

PIPELINE = {**SPEC, "plan": {"num_stages": 2, "num_microbatches": 2}}  # 2 stages on 2 workers: both log steps
WORKERS = ("local-0", "local-1")


def _json_lines(path: Path) -> list[dict[str, Any]]:
    """Every line of ``path`` as JSON (fails on a line that is not)."""
    lines = path.read_text().splitlines()
    assert lines, f"{path} is empty"
    return [json.loads(line) for line in lines]


def test_a_local_run_fills_its_run_directory_and_keeps_the_terminal_quiet(tmp_path: Path) -> None:
    spec = tmp_path / "tiny.json"
    run_dir = tmp_path / "run"
    spec.write_text(json.dumps({**PIPELINE, "logging": {"run_dir": str(run_dir), "format": "json"}}))
    proc = cellmesh("run", spec, "--workers", "2")  # the spec's logging section, no flag
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stderr == ""  # no log record reaches the terminal
    assert not [line for line in proc.stdout.splitlines() if line.lstrip().startswith("{")], proc.stdout
    assert proc.stdout.count(f"run directory {run_dir}") == 2, proc.stdout  # at the start and the end

    plan = Plan.from_json((run_dir / "plan.json").read_text())
    assert (run_dir / "plan.txt").read_text() == str(plan) + "\n" and str(plan) in proc.stdout
    record = RunRecord.model_validate_json((run_dir / "run.json").read_text())
    assert (record.phase, record.step, record.steps, record.workers) == ("done", 3, 3, list(WORKERS))
    assert record.output == str(run_dir / "model.pt") and record.loss is not None
    assert f"-> {record.loss:.4f} at step 3" in proc.stdout
    torch.load(run_dir / "model.pt", weights_only=True)
    assert (run_dir / "checkpoints").is_dir()

    coordinator = _json_lines(run_dir / "coordinator.log")
    assert any("2 workers up: local-0, local-1" in r["message"] for r in coordinator), coordinator
    for name in WORKERS:
        records = _json_lines(run_dir / "workers" / f"{name}.log")
        assert {r["worker"] for r in records} == {name}
        assert any(r["message"].startswith(f"cellmesh worker {name} of job ") for r in records), records
        hosting = [r for r in records if "hosting" in r["message"]]
        assert hosting and all(r["service"] == "worker" and r["level"] == "INFO" for r in hosting), records

    trace = json.loads((run_dir / "trace.json").read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    schedule = plan.schedule()
    for stage in range(plan.num_stages):  # every action of the plan's schedule, once per step and stage
        names = [e["name"] for e in events if e["pid"] == stage]
        for action in schedule.actions[stage]:  # each action under its printed name (``0F3``, ``1RECV_B2``)
            assert names.count(str(action)) == 3, (str(action), names)
    assert trace["otherData"] == {"steps_kept": [0, 1, 2], "steps_run": 3}


def test_a_flag_wins_over_the_spec_which_wins_over_the_environment(tmp_path: Path) -> None:
    spec = tmp_path / "tiny.json"
    spec_dir, flag_dir = tmp_path / "spec-run", tmp_path / "flag-run"
    spec.write_text(json.dumps({**PIPELINE, "steps": 1,
                                "logging": {"run_dir": str(spec_dir), "format": "human", "level": "ERROR"}}))
    proc = cellmesh("run", spec, "--workers", "2", "--run-dir", flag_dir, "--log-level", "INFO",
                    env={LOG_FORMAT_ENV: "json", LOG_LEVEL_ENV: "WARNING"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not spec_dir.exists() and (flag_dir / "model.pt").is_file()  # --run-dir over the spec's
    for log in (flag_dir / "coordinator.log", *(flag_dir / "workers" / f"{name}.log" for name in WORKERS)):
        lines = log.read_text().splitlines()
        assert lines and not [line for line in lines if line.startswith("{")], lines  # the spec's human
        assert [line for line in lines if " INFO " in line], lines  # --log-level INFO, in the workers too
    assert " INFO " in proc.stderr  # the terminal shows the level a flag chose


@pytest.fixture
def json_logs(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This process logs JSON at DEBUG (so the workers it starts do), as ``--log-format json`` would."""
    root = logging.getLogger()
    handlers, level, fmt = list(root.handlers), root.level, current_format()
    monkeypatch.setenv(LOG_LEVEL_ENV, "DEBUG")
    configure_logging(fmt="json", stream=io.StringIO())
    yield
    configure_logging(fmt=fmt, stream=io.StringIO())
    root.handlers[:] = handlers
    root.setLevel(level)


def _sample(body: str, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", body, re.MULTILINE)
    assert match, f"no {name} in\n{body}"
    return float(match.group(1))


@pytest.mark.usefixtures("json_logs")
def test_metrics_tensorboard_trace_and_logs_match_what_the_run_reported(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    spec = tmp_path / "tiny.json"
    spec.write_text(json.dumps({**PIPELINE, "steps": 4}))
    run_dir, tensorboard = tmp_path / "run", tmp_path / "tb"
    options = RunOptions(job=str(spec), settings={"runtime.workers": 2, "logging.run_dir": str(run_dir),
                                                  "logging.metrics_port": 0,
                                                  "logging.tensorboard_dir": str(tensorboard)})
    out = io.StringIO()
    served: list[tuple[int, float, float]] = []

    def during_the_run(record: StepRecord) -> None:
        match = re.search(r"metrics at (http://127\.0\.0\.1:\d+)/metrics", out.getvalue())
        assert match, out.getvalue()
        status, body = http_get(match.group(1) + "/metrics")
        assert status == 200, body
        served.append((int(_sample(body, "cellmesh_step")), _sample(body, "cellmesh_loss"),
                       _sample(body, "cellmesh_step_seconds_count")))

    result = train(load_job(str(spec), options.settings), options, out, on_step=during_the_run)
    losses = result.fit.losses
    assert len(losses) == 4
    assert served == [(k + 1, losses[k], k + 1) for k in range(4)]

    accumulator = EventAccumulator(str(tensorboard))
    accumulator.Reload()
    scalars = [(e.step, e.value) for e in accumulator.Scalars("loss")]
    assert scalars == [(k + 1, pytest.approx(loss, rel=1e-6)) for k, loss in enumerate(losses)]
    speeds = [(e.step, e.value) for e in accumulator.Scalars("samples_per_s")]
    assert speeds == [(r.step + 1, pytest.approx(r.num_samples / r.seconds, rel=1e-6))
                      for r in result.fit.steps]

    trace = json.loads((run_dir / "trace.json").read_text())
    written = [(e["args"]["step"], e["pid"], e["args"]["replica"], e["name"], e["dur"])
               for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "action"]  # not the predicted
    assert written == [(r.step, e.stage, e.replica, e.name, pytest.approx((e.end - e.start) * 1e6, abs=1e-3))
                       for r in result.fit.steps for e in r.events]

    for stage, name in enumerate(WORKERS):  # stage s runs on local-s (one replica)
        records = _json_lines(run_dir / "workers" / f"{name}.log")
        steps = {r["step"] for r in records
                 if r["step"] is not None and f"compute-r0-s{stage}" in r["service"]}
        assert steps == {0, 1, 2, 3}, records  # the compute service's DEBUG record of each step


def test_a_worker_that_cannot_start_is_reported_with_the_end_of_its_log(tmp_path: Path) -> None:
    harness = LocalHarness(["w0"], job="badlevel", env={LOG_LEVEL_ENV: "LOUD"}, log_dir=tmp_path / "logs")
    with pytest.raises(RuntimeError, match=r"(?s)worker w0 exited with code 2 before registering.*"
                                           r"CELLMESH_LOG_LEVEL='LOUD' is not a log level"):
        harness.start()
    assert (tmp_path / "logs" / "w0.log").is_file()  # kept: it failed
