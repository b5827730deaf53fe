"""Tied parameters across pipeline stages train as one process trains them.

``tied_gpt`` ties its token embedding (first stage) and its output head (last stage): both
stages hold a copy of the one matrix. Each plan's copies must end bit-identical to each other
and equal (float64, < 1e-9 after 5 steps) to ``train_reference``, where the matrix is one
Parameter whose gradient sums both uses. A checkpoint holds the matrix once and restores it
into both copies on another plan; a step that adds to the gradients it starts with adds its
own sum once. One harness of four workers serves every job here.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from comm.rpc import RpcClient
from coordinator.planning.resources import Resources
from coordinator.runtime.checkpoints import newest, state_keys
from coordinator.runtime.factories import build_chain, build_data, build_loss, build_model, unwrapped
from coordinator.runtime.harness import LocalHarness
from coordinator.runtime.job import Job, state_dict_of
from coordinator.runtime.records import StepRecord
from coordinator.runtime.reference import max_abs_diff, train_reference
from coordinator.runtime.session import Session
from coordinator.runtime.tied import shared_parameters, tied_per_stage
from services.checkpoint import dcp
from services.protocol import (
    Action,
    Assignment,
    AssignmentReply,
    BoundarySpec,
    BoundaryTensor,
    ComputeOptions,
    Empty,
    Release,
    RunStep,
    StepReply,
    TiedOptions,
)
from tests.multiproc.coordinator.models import SEQ
from tests.multiproc.coordinator.tied_models import WIDTH
from tests.multiproc.services.compute_checks import call_stages, fetch

pytestmark = pytest.mark.timeout(120)

T = "tests.multiproc.coordinator.tied_models"
M = "tests.multiproc.coordinator.models"
STEPS = 5
TOL = 1e-9
OWNER = "embed.tok.weight"  # the tied matrix, as every stage names it (the model's first name of it)
OPTIMIZERS: dict[str, tuple[str, dict[str, Any]]] = {
    "sgd": ("SGD", {"lr": 0.1, "momentum": 0.9}),
    "adamw": ("AdamW", {"lr": 0.01, "weight_decay": 0.1}),
}
PLANS: dict[str, dict[str, Any]] = {
    "gpipe2": dict(data_parallel=1, num_stages=2, num_microbatches=2, schedule="gpipe"),
    "1f1b2": dict(data_parallel=1, num_stages=2, num_microbatches=4, schedule="1f1b"),
    "pp2xdp2": dict(data_parallel=2, num_stages=2, num_microbatches=2, schedule="1f1b"),
    "ps2x2": dict(data_parallel=2, num_stages=2, num_microbatches=2, mode="parameter_server"),
    # the embedding on stage 0 (worker 0, with stage 2), the head on stage 3 (worker 1, with stage 1)
    "interleaved2x2": dict(data_parallel=1, num_stages=4, chunks=2, num_microbatches=2,
                           schedule="interleaved-1f1b", balance=[1, 1, 1, 1]),
    # the head's nn.Linear holds the tied matrix on stage 1: its gradient is deferred to the W's
    "zb2xdp2": dict(data_parallel=2, num_stages=2, num_microbatches=2, schedule="zb-h1"),
}

State = dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def harness() -> Iterator[LocalHarness]:
    factories = [f"{T}:tied_gpt", f"{M}:tokens", f"{M}:token_loss"]
    with LocalHarness([f"local-{i}" for i in range(4)], job="t-tied", lease_ttl=timedelta(seconds=6),
                      factories=factories) as h:
        yield h


def make_job(optimizer: str, **fields: Any) -> Job:
    name, kwargs = OPTIMIZERS[optimizer]
    return Job(model=f"{T}:tied_gpt", loss=f"{M}:token_loss", data=f"{M}:tokens", optimizer=name,
               optimizer_kwargs=kwargs, global_batch=8, seed=7, resources=Resources.local(workers=4),
               step_timeout_s=30, **{"balance": [2, 2], **fields})


def fit_both_copies(harness: LocalHarness, job: Job, steps: int = STEPS,
                    resume: Path | None = None) -> tuple[list[StepRecord], State, State]:
    """Train until step ``steps``; the records, the final state as the model's ``state_dict`` and as
    the stages hold it (cell-qualified: the tied matrix under each holding stage's name)."""
    session = Session(job, harness, resume).start()
    try:
        records, cell_state = session.fit(steps - job.steps_done, None)
        return records, state_dict_of(session.model, session.chain.named_tensors(), cell_state), cell_state
    finally:
        session.close()


def check_against_one_process(job: Job, state: State, records: list[StepRecord]) -> None:
    ref = train_reference(job, STEPS)
    # every loss takes both copies (the embedding on stage 0, the head on stage 1): copies that drift
    # apart show in the losses of the steps after, as well as in the final state
    assert max(abs(r.loss - loss) for r, loss in zip(records, ref.losses[-len(records):], strict=True)) < TOL
    diff = max_abs_diff(state, ref.state_dict)
    assert diff < TOL, f"{job.plan().summary()}: max abs diff {diff:.3g} >= {TOL:g}"
    initial = job.build_model().state_dict()
    assert max_abs_diff(initial, ref.state_dict) > 1e-3, "the reference did not move"


# every plan, each optimizer on a pipeline alone and with replicas (7 fits: the suite's time is shared)
@pytest.mark.parametrize(("plan", "optimizer"), [("gpipe2", "sgd"), ("1f1b2", "adamw"), ("pp2xdp2", "sgd"),
                                                 ("pp2xdp2", "adamw"), ("ps2x2", "adamw"),
                                                 ("interleaved2x2", "adamw"), ("zb2xdp2", "adamw")])
def test_tied_copies_train_as_one_parameter(harness: LocalHarness, plan: str, optimizer: str) -> None:
    job = make_job(optimizer, **PLANS[plan])
    records, state, _ = fit_both_copies(harness, job)
    check_against_one_process(job, state, records)
    phases = {e.name for e in records[-1].events}
    assert "tied_sync" in phases
    assert ("tied_share" in phases) == (plan == "ps2x2")  # the owner's pulled value, sent to the mirror


def test_a_checkpoint_holds_the_tied_matrix_once_and_restores_both_copies_on_another_plan(
        harness: LocalHarness, tmp_path: Path) -> None:
    first = make_job("adamw", checkpoint_directory=str(tmp_path), **PLANS["1f1b2"])
    fit_both_copies(harness, first, 3)
    checkpoint = newest(tmp_path)
    assert checkpoint is not None and checkpoint.name == "step-00000003"
    model, chain = build_chain(f"{T}:tied_gpt", {}, 7, ())
    keys = state_keys(model, chain.named_tensors())[OWNER]  # its keys in the model's state_dict
    assert len(keys) == 2
    owner_part, mirror_part = (set(dcp.keys(checkpoint / "parts" / f"r0-s{s}")) for s in (0, 1))
    assert set(keys) <= owner_part and not set(keys) & mirror_part
    train_keys = set(dcp.keys(checkpoint / "train" / "parts" / "r0-s1"))
    assert not any(k.startswith(f"optim.{keys[0]}.") for k in train_keys), "the mirror wrote its Adam state"

    # the stage holding the head is now stage 1 of two replicas: both of its copies start from the owner's
    second = make_job("adamw", checkpoint_directory=str(tmp_path), **{**PLANS["pp2xdp2"], "balance": [1, 3]})
    records, state, _ = fit_both_copies(harness, second, STEPS, resume=checkpoint)
    check_against_one_process(second, state, records)


def test_a_step_that_adds_to_its_gradients_adds_its_own_sum_once(harness: LocalHarness) -> None:
    """Two batches into one gradient (the second step without ``zero_grad``), driven over RPC, against
    one process's two backwards."""
    service, prefix = "tied-accumulate", f"/cellmesh/{harness.job}/tests/tied-accumulate"
    cut = BoundarySpec(structure="tensor", batch_size=2, tensors=[BoundaryTensor(
        name="x", dtype="float64", shape=[2, SEQ, WIDTH], requires_grad=True, batch_dim=0)])
    _, chain = build_chain(f"{T}:tied_gpt", {}, 7, ())
    tied = tied_per_stage(shared_parameters(chain), [(0, 2), (2, 4)])
    addresses = [harness.address(f"local-{s}") for s in range(2)]
    for s, address in enumerate(addresses):
        options = ComputeOptions(stage=s, num_stages=2, registry=harness.registry_url,
                                 comm_prefix=f"{prefix}/pipe", data=f"{M}:tokens", loss=f"{M}:token_loss",
                                 incoming=cut if s else None, outgoing=None if s else cut,
                                 tied=TiedOptions(prefix=f"{prefix}/tied", params=tied[s]))
        with RpcClient(address, timeout=timedelta(seconds=30)) as c:
            c.call("worker", "assign", Assignment(service=service, kind="compute", factory=f"{T}:tied_gpt",
                                                  nodes=[2 * s, 2 * s + 2], seed=7,
                                                  options=options.model_dump(mode="json")), AssignmentReply)
    gpipe = ["0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0RECV_B1 0B0 0B1",
             "1RECV_F0 1RECV_F1 1F0 1F1 1B0 1SEND_B0 1B1 1SEND_B1"]
    batches = [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    try:
        for step, microbatches in enumerate(batches):
            requests = [RunStep(step=step, microbatches=microbatches, zero_grad=step == 0, timeout_ms=20_000,
                                actions=[Action.parse(a) for a in gpipe[s].split()]) for s in range(2)]
            for result in call_stages(addresses, service, "run_step", requests, StepReply):
                assert not isinstance(result, Exception), result
        grads = [fetch([address], service, "gradients") for address in addresses]  # each stage's copy
    finally:
        for address in addresses:
            with RpcClient(address, timeout=timedelta(seconds=30)) as c:
                c.call("worker", "release", Release(service=service), Empty)
    assert torch.equal(grads[0][OWNER], grads[1][OWNER]), "the stages' tied gradients differ"
    source, loss_fn = build_data(f"{M}:tokens", {}, 7), build_loss(f"{M}:token_loss", {})
    whole = unwrapped(build_model(f"{T}:tied_gpt", {}, 7))
    for microbatches in batches:  # each step's mean loss, backwards accumulating
        inputs, targets = source.load([i for mb in microbatches for i in mb])
        loss_fn(whole(inputs), targets).backward()
    expected = dict(whole.named_parameters())["0.module.tok.weight"].grad
    assert expected is not None
    assert float((grads[0][OWNER] - expected).abs().max()) < 1e-12
