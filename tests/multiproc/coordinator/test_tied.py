"""Tied parameters across pipeline stages train as one process trains them.

``tied_gpt`` ties its token embedding (first stage) and its output head (last stage): both
stages hold a copy of the one matrix. Each plan's copies must end bit-identical to each other
and equal (float64, < 1e-9 after 5 steps) to ``train_reference``, where the matrix is one
Parameter whose gradient sums both uses. One harness of four workers serves every job here.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch

from coordinator.planning.resources import Resources
from coordinator.runtime.harness import LocalHarness
from coordinator.runtime.job import Job, state_dict_of
from coordinator.runtime.reference import max_abs_diff, train_reference
from coordinator.runtime.session import Session

pytestmark = pytest.mark.timeout(120)

T = "tests.multiproc.coordinator.tied_models"
M = "tests.multiproc.coordinator.models"
STEPS = 5
TOL = 1e-9
OWNER, MIRROR = "embed.tok.weight", "head.out.weight"  # the tied matrix as stage 0 and stage 1 name it
OPTIMIZERS: dict[str, tuple[str, dict[str, Any]]] = {
    "sgd": ("SGD", {"lr": 0.1, "momentum": 0.9}),
    "adamw": ("AdamW", {"lr": 0.01, "weight_decay": 0.1}),
}
PLANS: dict[str, dict[str, Any]] = {
    "gpipe2": dict(data_parallel=1, num_stages=2, num_microbatches=2, schedule="gpipe"),
    "1f1b2": dict(data_parallel=1, num_stages=2, num_microbatches=4, schedule="1f1b"),
    "pp2xdp2": dict(data_parallel=2, num_stages=2, num_microbatches=2, schedule="1f1b"),
}


@pytest.fixture(scope="module")
def harness() -> Iterator[LocalHarness]:
    factories = [f"{T}:tied_gpt", f"{M}:tokens", f"{M}:token_loss"]
    with LocalHarness([f"local-{i}" for i in range(4)], job="t-tied", lease_ttl=timedelta(seconds=2),
                      factories=factories) as h:
        yield h


def make_job(optimizer: str, **plan: Any) -> Job:
    name, kwargs = OPTIMIZERS[optimizer]
    return Job(model=f"{T}:tied_gpt", loss=f"{M}:token_loss", data=f"{M}:tokens", optimizer=name,
               optimizer_kwargs=kwargs, global_batch=8, seed=7, balance=[2, 2],
               resources=Resources.local(workers=4), step_timeout_s=30, **plan)


State = dict[str, torch.Tensor]


def fit_both_copies(harness: LocalHarness, job: Job) -> tuple[State, State]:
    """Train ``STEPS`` steps; the final state as the model's ``state_dict`` and as the stages hold it
    (cell-qualified: the tied matrix under each holding stage's name)."""
    session = Session(job, harness).start()
    try:
        _, cell_state = session.fit(STEPS, None)
        return state_dict_of(session.model, session.cells, cell_state), cell_state
    finally:
        session.close()


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("plan", list(PLANS))
def test_tied_copies_train_as_one_parameter(harness: LocalHarness, plan: str, optimizer: str) -> None:
    job = make_job(optimizer, **PLANS[plan])
    state, cells = fit_both_copies(harness, job)
    assert torch.equal(cells[OWNER], cells[MIRROR]), "the stages' copies of the tied matrix differ"
    ref = train_reference(job, STEPS)
    diff = max_abs_diff(state, ref.state_dict)
    assert diff < TOL, f"{job.plan().summary()}: max abs diff {diff:.3g} >= {TOL:g}"
    initial = job.build_model().state_dict()
    assert max_abs_diff(initial, ref.state_dict) > 1e-3, "the reference did not move"
