"""Models written without cells (tests/multiproc/coordinator/plain_models.py) train as one process does.

cellmesh traces them, cuts them inside (the stages' node ranges are asserted), relays the skip
connections of the ResNet across the cut, and returns a state_dict of the plain model. One harness
of four workers serves every job of this module; each trains 5 steps and is compared with
``coordinator.runtime.reference.train_reference``, which trains the module itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from coordinator.planning.resources import Resources
from coordinator.runtime.checkpoints import model_state, newest
from coordinator.runtime.harness import LocalHarness
from coordinator.runtime.job import FitResult, Job
from coordinator.runtime.reference import max_abs_diff, train_reference

pytestmark = pytest.mark.timeout(120)

P = "tests.multiproc.coordinator.plain_models"
STEPS = 5
TOL = 1e-9
DATA = {"gpt": ("tokens", "lm_loss"), "resnet": ("images", "cross_entropy"),
        "quantized": ("vectors", "cross_entropy"), "in_place": ("vectors", "cross_entropy"),
        "masked": ("masked_vectors", "cross_entropy")}
OPTIMIZERS: dict[str, tuple[str, dict[str, Any]]] = {
    "momentum": ("SGD", {"lr": 0.1, "momentum": 0.9}),
    "adamw": ("AdamW", {"lr": 0.01, "weight_decay": 0.01}),
}


@pytest.fixture(scope="module")
def harness() -> Iterator[LocalHarness]:
    factories = [f"{P}:{name}" for name in ("gpt", "resnet", "tokens", "images", "lm_loss", "cross_entropy",
                                                      "quantized", "vectors", "in_place", "masked",
                                                      "masked_vectors")]
    with LocalHarness([f"local-{i}" for i in range(4)], job="t-plain", lease_ttl=timedelta(seconds=6),
                      factories=factories) as h:
        yield h


def make_job(model: str, optimizer: str, **fields: Any) -> Job:
    data, loss = DATA[model]
    name, kwargs = OPTIMIZERS[optimizer]
    return Job(model=f"{P}:{model}", data=f"{P}:{data}", loss=f"{P}:{loss}", optimizer=name,
               optimizer_kwargs=kwargs, global_batch=16, seed=3, resources=Resources.local(workers=4),
               step_timeout_s=30, **fields)


def fit_and_compare(harness: LocalHarness, job: Job) -> FitResult:
    with job.attach(harness):
        result = job.fit(STEPS)
    ref = train_reference(job, STEPS)
    diff = max_abs_diff(result.state_dict, ref.state_dict)
    assert diff < TOL, f"{job.plan().summary()}: max abs diff {diff:.3g}"
    assert max(abs(a - b) for a, b in zip(result.losses, ref.losses, strict=True)) < TOL
    model = job.build_model()
    assert max_abs_diff(model.state_dict(), ref.state_dict) > 1e-3, "the reference did not move"
    model.load_state_dict(result.state_dict, strict=True)  # the plain model's own keys
    return result


@pytest.mark.parametrize(("plan", "optimizer"), [
    ({"num_stages": 2, "data_parallel": 1, "num_microbatches": 4, "schedule": "1f1b"}, "adamw"),
    ({"num_stages": 2, "data_parallel": 2, "num_microbatches": 2, "schedule": "1f1b"}, "momentum"),
], ids=["1f1b2", "pp2xdp2"])
def test_gpt_cut_between_its_blocks(harness: LocalHarness, plan: dict[str, Any], optimizer: str) -> None:
    job = make_job("gpt", optimizer, balance=[3, 4], **plan)
    first, second = job.plan().stages
    assert (first.start, first.stop, second.stop) == (0, 3, 7)
    assert first.nodes == ("tok", "blocks.0", "blocks.1") and second.nodes[-1] == "head"
    assert first.outgoing.structure == "tensor"
    fit_and_compare(harness, job)


def test_gpt_data_parallel(harness: LocalHarness) -> None:
    result = fit_and_compare(harness, make_job("gpt", "momentum", data_parallel=2, num_stages=1,
                                               num_microbatches=1))
    assert result.plan is not None and result.plan.stages[0].nodes[0] == "tok"


def test_resnet_skips_cross_the_cuts_and_the_middle_stage_relays_them_on_gpipe(harness: LocalHarness) -> None:
    job = make_job("resnet", "adamw", num_stages=3, data_parallel=1, num_microbatches=4, schedule="gpipe",
                   balance=[3, 3, 3])
    first, middle, last = job.plan().stages
    assert first.nodes == ("stem", "blocks.0", "shortcuts.0") and last.nodes[-1] == "stem_head"
    # the long skip (relu) and the block's output (relu_1) cross together; the middle stage relays the skip
    assert first.outgoing.structure == "values"
    assert [t.name for t in first.outgoing.tensors] == ["relu", "relu_1"]
    assert [t.name for t in middle.outgoing.tensors] == ["relu", "relu_2", "blocks_2"]
    fit_and_compare(harness, job)


def test_resnet_on_stages_and_replicas_with_parameter_servers_and_a_checkpoint(harness: LocalHarness,
                                                                                 tmp_path: Path) -> None:
    job = make_job("resnet", "momentum", num_stages=2, data_parallel=2, num_microbatches=2, schedule="1f1b",
                   mode="parameter_server", balance=[3, 6], checkpoint_directory=str(tmp_path),
                   checkpoint_every_steps=STEPS)
    result = fit_and_compare(harness, job)
    checkpoint = newest(tmp_path)
    assert checkpoint is not None
    saved = model_state(checkpoint)  # keyed as the plain model's state_dict
    assert saved.keys() == result.state_dict.keys()
    assert max_abs_diff(saved, result.state_dict) == 0.0


def test_gpt_auto_plan(harness: LocalHarness) -> None:
    result = fit_and_compare(harness, make_job("gpt", "adamw"))
    plan = result.plan
    assert plan is not None and plan.num_workers <= 4
    assert plan.bounds[0] == 0 and plan.bounds[-1] == 7 and list(plan.bounds) == sorted(set(plan.bounds))


def test_custom_autograd_functions_train_with_their_own_backward_on_two_stages(harness: LocalHarness) -> None:
    # a graph of the functions' forward operations would give the first layer no gradient (rounding's
    # derivative is zero) and the second twice its gradient: the reference trains the model itself
    job = make_job("quantized", "momentum", num_stages=2, data_parallel=1, num_microbatches=2,
                   schedule="1f1b", balance=[1, 2])
    assert [s.nodes for s in job.plan().stages] == [("first",), ("second", "out")]
    result = fit_and_compare(harness, job)
    assert max_abs_diff({"w": result.state_dict["first.weight"]},
                        {"w": job.build_model().state_dict()["first.weight"]}) > 1e-3  # the first one trained


@pytest.mark.parametrize("balance", [[1, 3], [2, 2]], ids=["before-relu", "before-add"])
def test_a_stage_that_begins_by_changing_what_it_receives_in_place(harness: LocalHarness,
                                                                   balance: list[int]) -> None:
    # stage 1 begins with the in-place ReLU on the received value, or adds into the received skip
    job = make_job("in_place", "adamw", num_stages=2, data_parallel=1, num_microbatches=2,
                   schedule="1f1b", balance=balance)
    fit_and_compare(harness, job)


@pytest.mark.parametrize("as_dict", [False, True], ids=["tuple", "dict"])
def test_a_forward_of_several_arguments_gets_the_inputs_spread(harness: LocalHarness, as_dict: bool) -> None:
    # forward(x, mask, scale=2.0): the mask crosses the cut to the stage that uses it
    job = make_job("masked", "adamw", num_stages=2, data_parallel=1, num_microbatches=2, schedule="1f1b",
                   balance=[1, 2], data_kwargs={"as_dict": as_dict})
    first, _ = job.plan().stages
    assert [t.name for t in first.outgoing.tensors] == ["argument_1", "tanh"]  # the mask goes along
    fit_and_compare(harness, job)
