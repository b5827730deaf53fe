"""Evaluation on held-out data: the same numbers one process computes, and nothing training sees changes.

One harness of two worker processes serves every job of this module (``Job.attach``). Each job
trains 5 steps (float64) and evaluates after steps 2, 4 and 5 (every 2, and the end of the
fit) on 37 held-out samples, an uneven number: the last batch and its microbatches are short.
Every evaluation is compared with ``coordinator.runtime.reference.train_reference``, which
evaluates one process's model on the whole held-out set in one forward (< 1e-9). A model
with BatchNorm and dropout trains to bit-identical parameters and buffers with and without
evaluation, and the checkpoints due where it evaluates hold their steps' models. ``cellmesh
run``'s path (``commands.run.train``, on this harness) writes the evaluations to the run
record and TensorBoard.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from coordinator.commands.jobspec import load_job
from coordinator.commands.run import RunOptions, train
from coordinator.commands.rundir import RunRecord
from coordinator.planning.resources import Resources
from coordinator.runtime.checkpoints import model_state
from coordinator.runtime.harness import LocalHarness
from coordinator.runtime.job import FitResult, Job
from coordinator.runtime.reference import max_abs_diff, train_reference

pytestmark = pytest.mark.timeout(120)

M = "tests.multiproc.coordinator.models"
E = "tests.multiproc.coordinator.eval_models"
STEPS = 5
TOL = 1e-9
FACTORIES = [f"{M}:mlp", f"{M}:regression", f"{M}:mse", f"{E}:bn_model", f"{E}:heldout",
             f"{E}:heldout_loader", f"{E}:abs_error", "torch.nn:L1Loss"]


@pytest.fixture(scope="module")
def harness() -> Iterator[LocalHarness]:
    with LocalHarness(["local-0", "local-1"], job="t-eval", lease_ttl=timedelta(seconds=6),
                      factories=FACTORIES) as h:
        yield h


def make_job(model: str, *, held_out: dict[str, Any] | None = None, evaluate: bool = True,
             **plan: Any) -> Job:
    evaluation = {"eval": f"{E}:heldout", "eval_every_steps": 2, "eval_metric": f"{E}:abs_error",
                  **(held_out or {})} if evaluate else {}
    return Job(model=model, loss=f"{M}:mse", data=f"{M}:regression", optimizer="SGD",
               optimizer_kwargs={"lr": 0.1, "momentum": 0.9}, global_batch=16, seed=5,
               resources=Resources.local(workers=2), step_timeout_s=30, **evaluation, **plan)


def fit_and_compare(harness: LocalHarness, job: Job) -> FitResult:
    with job.attach(harness):
        result = job.fit(STEPS)
    ref = train_reference(job, STEPS)
    assert max_abs_diff(result.state_dict, ref.state_dict) < TOL
    assert [e.step for e in result.evals] == [e.step for e in ref.evals] == [2, 4, 5]
    assert [r.step + 1 for r in result.steps if r.eval is not None] == [2, 4, 5]  # on the records too
    for got, want in zip(result.evals, ref.evals, strict=True):
        assert got.num_samples == want.num_samples == 37
        assert abs(got.loss - want.loss) < TOL, (got, want)
        assert got.metric is not None and want.metric is not None and abs(got.metric - want.metric) < TOL
    assert len({e.loss for e in result.evals}) == 3, "training did not change the held-out loss"
    return result


def test_data_parallel_evaluation_equals_one_process(harness: LocalHarness) -> None:
    # batches 16, 16, 5: the last split 3 + 2 over the replicas; the metric one value per sample
    fit_and_compare(harness, make_job(f"{M}:mlp", data_parallel=2, num_stages=1, num_microbatches=1))


def test_pipeline_evaluation_equals_one_process(harness: LocalHarness) -> None:
    # batches of 10: 10, 10, 10, 7 in 4 microbatches (3 3 2 2, 2 2 2 1); a loader; the metric one mean value
    held_out = {"eval": f"{E}:heldout_loader", "eval_num_samples": 37, "eval_global_batch": 10,
                "eval_metric": "torch.nn:L1Loss"}
    fit_and_compare(harness, make_job(f"{M}:mlp", held_out=held_out, data_parallel=1, num_stages=2,
                                      num_microbatches=4, schedule="1f1b"))


def test_interleaved_evaluation_equals_one_process(harness: LocalHarness) -> None:
    # 2 stages on each worker: their training steps take turns, their evaluation steps run side by side
    fit_and_compare(harness, make_job(f"{M}:mlp", data_parallel=1, num_stages=4, chunks=2, num_microbatches=2,
                                      schedule="interleaved-1f1b", balance=[2, 1, 2, 1]))


def test_batchnorm_and_dropout_evaluate_in_eval_mode_and_change_nothing(harness: LocalHarness,
                                                                        tmp_path: Path) -> None:
    # one microbatch: the BatchNorm's training statistics are the whole batch's, as in one process
    plan = dict(data_parallel=1, num_stages=2, num_microbatches=1, balance=[2, 3])
    job = make_job(f"{E}:bn_model", checkpoint_directory=str(tmp_path), checkpoint_every_steps=2,
                   checkpoint_keep=3, **plan)
    result = fit_and_compare(harness, job)
    # the checkpoints due where the job evaluates ride on the evaluation's commit: each holds its step's model
    assert [p.name for p in sorted(tmp_path.glob("step-*"))] == ["step-00000002", "step-00000004",
                                                                 "step-00000005"]
    assert max_abs_diff(model_state(tmp_path / "step-00000002"), train_reference(job, 2).state_dict) < TOL
    final = model_state(tmp_path / "step-00000005")
    assert all(torch.equal(final[k], v) for k, v in result.state_dict.items())
    plain = make_job(f"{E}:bn_model", evaluate=False, **plan)
    with plain.attach(harness):
        without = plain.fit(STEPS)
    assert without.evals == [] and all(r.eval is None for r in without.steps)
    assert result.state_dict.keys() == without.state_dict.keys()
    for key, value in result.state_dict.items():  # parameters and the BatchNorm's buffers, bit for bit
        assert torch.equal(value, without.state_dict[key]), key
    initial = plain.build_model().state_dict()
    assert not torch.equal(initial["1.module.running_mean"], result.state_dict["1.module.running_mean"])


def test_a_run_with_an_eval_section_records_its_evaluations(harness: LocalHarness, tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    spec = tmp_path / "tiny.json"
    spec.write_text(json.dumps({
        "version": 2, "steps": 3, "model": {"factory": f"{M}:mlp"}, "loss": {"factory": f"{M}:mse"},
        "data": {"factory": f"{M}:regression", "global_batch": 16, "seed": 1},
        "plan": {"data_parallel": 2, "num_stages": 1}, "optimizer": {"name": "SGD", "kwargs": {"lr": 0.1}}}))
    run_dir, tensorboard = tmp_path / "run", tmp_path / "tb"
    settings = {"eval.factory": f"{E}:heldout", "eval.every_steps": 2, "eval.metric": f"{E}:abs_error",
                "runtime.workers": 2, "logging.run_dir": str(run_dir),
                "logging.tensorboard_dir": str(tensorboard)}
    options = RunOptions(job=str(spec), settings=settings, bar=False)
    out = io.StringIO()
    result = train(load_job(str(spec), options.settings), options, out, pool=harness)

    evals = result.fit.evals
    assert [e.step for e in evals] == [2, 3]  # every 2 steps, and the end of the run
    ref = train_reference(result.loaded.job, 3).evals
    assert all(abs(a.loss - b.loss) < TOL and abs((a.metric or 0) - (b.metric or 0)) < TOL
               for a, b in zip(evals, ref, strict=True))
    record = RunRecord.model_validate_json((run_dir / "run.json").read_text())
    assert [(e.step, e.loss, e.metric, e.num_samples) for e in record.evals] == [
        (e.step, e.loss, e.metric, 37) for e in evals]
    for e in evals:
        line = f"eval after step {e.step}/3  loss {e.loss:.4f}  metric {e.metric:.4f}  (37 samples"
        assert line in out.getvalue(), out.getvalue()
    assert (f"held-out loss {evals[-1].loss:.4f}  metric {evals[-1].metric:.4f} after step 3 (37 samples; "
            "2 evaluation(s) in run.json)") in out.getvalue()
    accumulator = EventAccumulator(str(tensorboard))
    accumulator.Reload()
    for name, values in (("eval/loss", [e.loss for e in evals]), ("eval/metric", [e.metric for e in evals])):
        assert [(s.step, s.value) for s in accumulator.Scalars(name)] == [
            (e.step, pytest.approx(v, rel=1e-6)) for e, v in zip(evals, values, strict=True)]
