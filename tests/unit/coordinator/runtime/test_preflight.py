"""A job's checks before any worker starts (``Job.check``): one line for each bad job, naming what to fix.

The same jobs run through ``cellmesh run`` in tests/multiproc/coordinator/test_bad_jobs.py; here
the checks themselves, in this process, and the planner's pieces they use.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from coordinator.planning.config import PlanConfig
from coordinator.planning.planner import CellBytes, check_memory_floor, memory_floor
from coordinator.planning.request import PlanningError, batch_note, check_batch
from coordinator.planning.resources import Resources, Worker
from coordinator.runtime.errors import JobError
from coordinator.runtime.job import Job
from coordinator.runtime.preflight import check_optimizer, node_bytes, optimizer_keywords
from tests.multiproc.coordinator import bad_models

M = "tests.multiproc.coordinator.models"
B = "tests.multiproc.coordinator.bad_models"
GiB = 2**30


def job(**fields: Any) -> Job:
    given: dict[str, Any] = {"model": f"{M}:mlp", "data": f"{M}:regression", "loss": f"{M}:mse",
                             "global_batch": 16, "resources": Resources.local(2), **fields}
    return Job(**given)


def one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text, text
    return text


def test_a_good_job_passes_and_keeps_its_cells_and_sample() -> None:
    checked = job().check()
    assert [nd.name for nd in checked.chain.nodes] == [f"cell{i}" for i in range(6)]
    assert isinstance(checked.sample, torch.Tensor) and list(checked.sample.shape) == [8, 6]
    sizes = node_bytes(checked.chain)
    assert [s.num_params for s in sizes] == [6 * 12 + 12, 0, 12 * 12 + 12, 0, 12 * 12 + 12, 12 * 3 + 3]
    assert [s.param_bytes for s in sizes] == [8 * s.num_params for s in sizes]  # float64


def test_a_factory_that_raises_is_named_with_its_line() -> None:
    with pytest.raises(JobError) as info:
        job(model=f"{B}:raising").check()
    text = one_line(info.value)
    assert text.startswith(f"model factory '{B}:raising' raised RuntimeError: the width must be even (at ")
    assert "bad_models.py:" in text and "fix the factory or model.kwargs" in text


def test_cells_that_do_not_fit_are_named_with_the_shapes() -> None:
    with pytest.raises(JobError) as info:
        job(model=f"{B}:misfit").check()
    text = one_line(info.value)
    assert f"model factory '{B}:misfit': cell 'cell2' (Linear(in_features=14, out_features=3" in text
    assert ("fails on the output of cell 'cell1', [8, 12] float64: mat1 and mat2 shapes cannot be "
            "multiplied") in text
    assert "While executing" not in text  # none of torch.fx's pages


def test_a_loss_that_does_not_take_the_output_is_named() -> None:
    with pytest.raises(JobError) as info:
        job(loss=f"{B}:mismatched_loss").check()
    assert one_line(info.value).startswith(
        f"loss factory '{B}:mismatched_loss' fails on the model's output, [8, 3] float64, and the targets of "
        f"data factory '{M}:regression', [8, 3] float64: mat1 and mat2 shapes cannot be multiplied")
    with pytest.raises(JobError, match=r"returns \[8, 3\] float64, not a one-element tensor"):
        job(loss="torch.nn:MSELoss", loss_kwargs={"reduction": "none"}).check()


@pytest.mark.parametrize(("factory", "cause", "fix"), [
    # found on the model's layers, before it is built for real
    ("sparse_embedding", "layer 0 (Embedding) is built with sparse=True", "build it with sparse=False"),
    # no layer to find: found by the gradient of a sample
    ("looked_up", "parameter 'table' gets a torch.sparse_coo gradient", "look it up with sparse=False"),
], ids=["embedding-layer", "functional-lookup"])
def test_sparse_gradients_are_refused_with_the_fix(factory: str, cause: str, fix: str) -> None:
    with pytest.raises(JobError) as info:
        job(model=f"{B}:{factory}", data=f"{B}:tokens").check()
    text = one_line(info.value)
    assert text.startswith(f"model factory '{B}:{factory}': {cause}")
    assert fix in text
    job(model=f"{B}:{factory}", model_kwargs={"sparse": False}, data=f"{B}:tokens").check()  # the fix


def test_cells_and_data_of_different_dtypes_are_named() -> None:
    with pytest.raises(JobError, match=r"cell 'cell0' \(Linear\(.*\)\) fails on the inputs of data factory "
                                       rf"'{M}:regression', \[8, 6\] float32: .*Float and Double"):
        job(data_kwargs={"dtype": "float32"}).check()


def test_inputs_and_targets_of_different_lengths_are_refused() -> None:
    with pytest.raises(JobError, match=rf"data factory '{B}:uneven' returns 256 inputs but 200 targets"):
        job(data=f"{B}:uneven").check()


def test_data_of_fewer_samples_than_one_global_batch_is_refused_naming_both() -> None:
    """Before: a bare ``ValueError: global_batch=128 must be between 1 and the 64 samples of the data``
    when the fit began, naming neither the factory nor the field; ``check`` passed."""
    wanted = (rf"data factory '{M}:regression' gives 64 samples, fewer than one global batch "
              r"\(data.global_batch=128\): lower data.global_batch to at most 64")
    too_big = job(global_batch=128)
    with pytest.raises(JobError, match=wanted):
        too_big.check()
    with pytest.raises(JobError, match=wanted):  # what Job.fit builds before any worker starts
        too_big.sampler()


@pytest.mark.parametrize(("fields", "wanted"), [
    ({"num_samples": 1000}, rf"data.num_samples=1000 but data factory '{M}:regression' returns 64 samples: "
                            "lower data.num_samples or leave it out"),
    ({"data": f"{M}:failing_data"},
     rf"data factory '{M}:failing_data' returns a loader: give data.num_samples"),
])
def test_a_sample_count_the_data_does_not_have_is_refused_naming_the_field(fields: dict[str, Any],
                                                                           wanted: str) -> None:
    """Before: check passed; more samples than the tensors hold failed step 0 on a worker ('sample indices
    [675, ...] are beyond the 64 samples of the data'), a loader without a count failed the fit's start."""
    with pytest.raises(JobError, match=wanted):
        job(**fields).check()


@pytest.mark.parametrize(("plan", "option"), [
    ({"num_stages": 3}, "plan.num_stages=3"),
    ({"balance": [1, 1, 1]}, "plan.balance=[1, 1, 1]"),
])
def test_a_plain_module_asked_for_more_stages_than_nodes_is_told_its_nodes(plan: dict[str, Any],
                                                                           option: str) -> None:
    with pytest.raises(JobError) as info:
        job(model=f"{B}:plain", resources=Resources.local(3), **plan).check()
    text = one_line(info.value)
    assert f"model factory '{B}:plain' returns a Plain that torch.fx traces into 2 node(s) (a, b)" in text
    assert option in text and "at most 2 stage(s)" in text and "cellmesh.Cell(name, module)" in text


def test_a_plain_module_is_cut_into_its_nodes() -> None:
    checked = job(model=f"{B}:plain", strategy="pipeline").check()
    assert [nd.name for nd in checked.chain.nodes] == ["a", "b"]  # tanh joins a
    assert [s.num_params for s in node_bytes(checked.chain)] == [6 * 12 + 12, 12 * 3 + 3]


def test_an_untraceable_submodule_is_named_with_the_fix() -> None:
    with pytest.raises(JobError) as info:
        job(model=f"{B}:gated").check()
    text = one_line(info.value)
    assert text.startswith(f"model factory '{B}:gated': torch.fx cannot trace submodule 'gate' (Gate): "
                           "TraceError: symbolically traced variables cannot be used as inputs to control "
                           "flow; list it in model.leaves")
    assert "cellmesh.Cell" in text
    checked = job(model=f"{B}:gated", leaves=["gate"]).check()
    assert [nd.name for nd in checked.chain.nodes] == ["a", "gate", "b"]


def test_more_stages_than_cells_is_refused_naming_the_cells() -> None:
    with pytest.raises(JobError, match=r"returns 6 cell\(s\) \(cell0, .*, cell5\): it cannot be cut into "):
        job(num_stages=7, resources=Resources.local(8)).check()


def test_a_model_too_big_for_any_plan_is_refused_on_the_meta_device_in_seconds() -> None:
    started = time.monotonic()
    with pytest.raises(PlanningError) as info:
        job(model=f"{B}:huge", data=f"{B}:huge_data", optimizer="Adam").check()
    assert time.monotonic() - started < 10
    text = one_line(info.value)
    assert text.startswith(
        "the model is too big for these workers: its 160B parameters (596 GiB), their gradients (596 GiB) "
        "and adam optimizer state (1.16 TiB) need at least 1.16 TiB on one worker even spread over 2 workers "
        "(1 replica(s) x 2 stage(s), collective), and the largest worker has "), text


def test_a_factory_that_does_not_build_on_the_meta_device_is_measured_built_for_real() -> None:
    checked = job(model=f"{B}:not_on_meta").check()
    assert len(checked.chain) == 3
    with pytest.raises(PlanningError, match="too big for these workers"):
        tiny = Resources(workers=(Worker(name="w", memory_bytes=1000),))
        job(model=f"{B}:not_on_meta", resources=tiny).check()


def test_a_fixed_replica_count_the_batch_does_not_split_into_is_refused() -> None:
    with pytest.raises(PlanningError, match=r"global_batch=33 does not split evenly into data_parallel=2 "
                                            r"replicas; .* a multiple of 2 \(32 or 34\)"):
        job(global_batch=33, data_parallel=2).check()
    with pytest.raises(PlanningError, match=r"strategy='data_parallel' on 2 workers .* global_batch=33 "
                                            r"splits into none of 2..2: use a multiple of 2 \(32 or 34\)"):
        job(global_batch=33, strategy="data_parallel").check()
    with pytest.raises(PlanningError, match=r"num_microbatches=5 does not divide global_batch=16"):
        check_batch(PlanConfig(num_microbatches=5), 6, 2, 16)
    check_batch(PlanConfig(), 6, 2, 33)  # the planner chooses: not an error


def test_the_batch_note_says_when_the_batch_left_workers_idle() -> None:
    auto = PlanConfig()
    note = batch_note(1, 1, auto, 2, 33)
    assert note == ("global_batch=33 does not split evenly into 2 replicas, so the plan uses 1 of the 2 "
                    "workers (1 replica(s) x 1 stage(s)); a global batch that is a multiple of 2 (32 or 34) "
                    "lets the planner use 2")
    assert batch_note(3, 1, PlanConfig(strategy="data_parallel"), 4, 3) is not None  # 3 samples on 4 workers
    assert batch_note(1, 1, auto, 2, 32) is None  # the planner chose one worker for speed
    assert batch_note(2, 1, auto, 2, 32) is None  # every worker used
    assert batch_note(1, 1, auto, 4, 16) is None  # 2 or 4 replicas could run it: chosen for speed
    assert batch_note(1, 1, auto, 3, 5) is not None  # neither 2 nor 3 replicas split 5 samples
    assert batch_note(1, 1, PlanConfig(data_parallel=1), 2, 33) is None  # the user fixed it


def test_the_memory_floor_spreads_the_cells_as_far_as_the_workers_allow() -> None:
    cells = [CellBytes(name=f"c{i}", num_params=GiB // 4, param_bytes=GiB, buffer_bytes=0,
                       trainable_bytes=GiB) for i in range(4)]
    # SGD: parameters and gradients, 2 GiB a cell; 2 workers: two stages of two cells each
    assert memory_floor(cells, 2, "sgd") == (4 * GiB, "1 replica(s) x 2 stage(s), collective")
    # Adam: 4 GiB a cell; parameter-server mode over 4 replicas keeps 2 GiB of each cell whole and
    # shards the 3 GiB of state and master copy: 4 cells x 2.75 GiB on one stage, against 1 cell x 4 GiB
    need, shape = memory_floor(cells, 4, "adam")
    assert (need, shape) == (4 * GiB, "1 replica(s) x 4 stage(s), collective")
    assert memory_floor(cells[:1], 4, "adam") == (2.75 * GiB, "4 replica(s) x 1 stage(s), parameter_server")
    fits = Resources(workers=tuple(Worker(name=f"w{i}", memory_bytes=4 * GiB) for i in range(4)))
    check_memory_floor(cells, fits, "adam")
    small = Resources(workers=tuple(Worker(name=f"w{i}", memory_bytes=4 * GiB - 1024) for i in range(4)))
    with pytest.raises(PlanningError, match=r"its 1.07B parameters \(4 GiB\).* need at least 4 GiB on one "
                                            r"worker .* largest worker has 4 GiB"):
        check_memory_floor(cells, small, "adam")


def test_the_model_built_for_the_checks_is_the_one_planned() -> None:
    j = job(model=bad_models.one_linear, global_batch=33)
    checked = j.check()
    assert j.check() is checked  # kept until planning


def test_a_model_with_nothing_to_train_is_refused() -> None:
    with pytest.raises(JobError, match=rf"model factory '{B}:frozen': none of the model's parameters "
                                       "requires a gradient .*leave requires_grad=True"):
        job(model=f"{B}:frozen").check()
    job(model=f"{B}:frozen", model_kwargs={"everything": False}).check()  # a frozen first layer trains


def test_a_loss_that_depends_on_no_parameter_is_refused() -> None:
    with pytest.raises(JobError, match=rf"model factory '{B}:detached' with loss factory '{M}:mse': the "
                                       "loss on a sample does not depend on any parameter"):
        job(model=f"{B}:detached").check()


def test_a_backward_that_raises_is_named() -> None:
    with pytest.raises(JobError) as info:
        job(model=f"{B}:no_backward").check()
    text = one_line(info.value)
    assert text.startswith(f"model factory '{B}:no_backward': the backward of the loss on a sample fails: ")
    assert "the derivative for 'round_up' is not implemented" in text


def test_an_unknown_optimizer_keyword_is_named_with_a_close_match_and_the_keywords_taken() -> None:
    """Before: a spec's typo reached torch and ``cellmesh run`` printed ``ValueError: optimizer SGD({...}):
    SGD.__init__() got an unexpected keyword argument 'momentun'``, naming no field."""
    bad = job(optimizer="SGD", optimizer_kwargs={"lr": 0.1, "momentun": 0.9})
    with pytest.raises(JobError) as info:
        check_optimizer(bad.config)
    text = one_line(info.value)
    assert text.startswith("optimizer.kwargs: SGD takes no keyword 'momentun' (did you mean 'momentum'?); it "
                           "takes lr, momentum, dampening, weight_decay, nesterov"), text
    assert text.endswith("; fix optimizer.kwargs"), text
    with pytest.raises(JobError, match=r"^optimizer.kwargs: SGD takes no keyword 'momentun'"):
        bad.plan()  # what the Python API runs before any worker starts
    with pytest.raises(JobError, match=r"no keyword 'xyzzy'; it takes lr, betas"):  # nothing close
        check_optimizer(job(optimizer="AdamW", optimizer_kwargs={"xyzzy": 1}).config)
    says = r"no keyword 'params', 'weight_decai' \(did you mean 'weight_decay'\?\)"
    with pytest.raises(JobError, match=says):  # cellmesh passes the parameters itself
        check_optimizer(job(optimizer="Adam", optimizer_kwargs={"params": [], "weight_decai": 0.1}).config)
    good = {"lr": 0.1, "momentum": 0.9, "nesterov": True}
    check_optimizer(job(optimizer="SGD", optimizer_kwargs=good).config)
    assert optimizer_keywords("NoSuchOptimizer") is None  # named by the check that builds it

