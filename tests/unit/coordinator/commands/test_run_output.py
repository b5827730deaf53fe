"""Where ``cellmesh run`` writes the trained model: checked before training, never lost after it."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from coordinator.commands.jobspec import LoadedJob
from coordinator.commands.run import OutputError, RunResult, check_writable, report, save_outputs, summary
from coordinator.commands.rundir import RunDir
from coordinator.runtime.errors import JobError
from coordinator.runtime.job import FitResult
from coordinator.runtime.nonfinite import NonFiniteStep
from coordinator.runtime.records import StepRecord

STATE = {"w": torch.arange(4.0), "b": torch.zeros(2)}


@pytest.mark.parametrize(("path", "says"), [
    (Path("/proc/cellmesh-test.pt"), "cannot write the state_dict to /proc/cellmesh-test.pt: "),
    (Path("/proc/cellmesh-test/model.pt"), "cannot create the output directory /proc/cellmesh-test: "),
])
def test_an_output_the_file_system_refuses_fails_before_training(path: Path, says: str) -> None:
    # /proc is r-x for everyone: os.access() says yes to root, creating a file there says no
    with pytest.raises(OutputError, match="^" + says + r".*; give an output path \(-o\) in a directory"):
        check_writable(path)


def test_the_check_leaves_an_earlier_output_as_it_was(tmp_path: Path) -> None:
    earlier = tmp_path / "model.pt"
    earlier.write_bytes(b"a good model")
    check_writable(earlier)
    assert earlier.read_bytes() == b"a good model" and sorted(tmp_path.iterdir()) == [earlier]
    with pytest.raises(OutputError, match="it is a directory"):
        check_writable(tmp_path)


def test_an_output_that_fails_at_the_end_does_not_lose_the_model(tmp_path: Path) -> None:
    run_dir = RunDir.create("tiny", tmp_path / "run")
    with pytest.raises(OutputError) as info:
        save_outputs(STATE, run_dir, Path("/proc/cellmesh-test.pt"))
    text = str(info.value)
    assert text.startswith("the trained state_dict could not be written to /proc/cellmesh-test.pt (")
    assert text.endswith(f"it is saved in {run_dir.model}: copy it from there")
    saved = torch.load(run_dir.model, weights_only=True)
    assert saved.keys() == STATE.keys() and all(torch.equal(saved[k], STATE[k]) for k in STATE)


def test_when_no_place_can_be_written_a_temporary_directory_holds_it(tmp_path: Path) -> None:
    nowhere = RunDir(Path("/proc/cellmesh-test-run"))
    with pytest.raises(OutputError) as info:
        save_outputs(STATE, nowhere, None)
    where = Path(str(info.value).rsplit("it is saved in ", 1)[1].removesuffix(": copy it from there"))
    try:
        assert where.name == "model.pt" and torch.equal(torch.load(where, weights_only=True)["w"], STATE["w"])
    finally:
        where.unlink()
        where.parent.rmdir()


@pytest.mark.parametrize("exc", [
    JobError("model factory 'a:b' raised RuntimeError: boom (at a.py:3); fix the factory or model.kwargs"),
    OutputError("cannot write the state_dict to /proc/x.pt: No such file or directory; give an output path"),
    NonFiniteStep("step 3: the loss of microbatch 0 is nan on stage 1", step=2, stage=1, last_good_loss=0.5),
])
def test_a_bad_job_is_one_line_and_exit_code_2(exc: Exception) -> None:
    err = io.StringIO()
    assert report(exc, err=err) == 2
    assert err.getvalue() == f"cellmesh: error: {exc}\n"


def test_the_summary_of_a_resumed_run_names_its_steps_from_the_job_s_start(tmp_path: Path) -> None:
    """Resumed at step 4 of 24: 'loss ... at step 5 -> ... at step 24' (before: 'at step 1 -> ... at step
    20', while the resume line and the recoveries count from the job's start)."""
    steps = [StepRecord(step=k, loss=1.0 / (k + 1), num_samples=16, start=0.0, end=0.0, coordinator_s=0.0)
             for k in range(4, 24)]
    fit = FitResult(losses=[r.loss for r in steps], state_dict=STATE, steps=steps)
    loaded = LoadedJob(job=None, name="tiny", source="job spec tiny.yaml", module=None)  # type: ignore[arg-type]
    result = RunResult(loaded=loaded, fit=fit, run_dir=RunDir(tmp_path), output=None, seconds=1.0,
                       samples_per_s=1.0, overall_samples_per_s=1.0)
    assert "loss 0.2000 at step 5 -> 0.0417 at step 24 " in summary(result)

