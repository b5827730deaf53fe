"""The cell compute service: two-stage pipelines in real worker processes against one process.

Two worker processes host every pipeline of this module (each test assigns its own pair
of services, under its own communicator prefix), driven by the test process over RPC.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import msgpack
import pytest
import torch

from comm.codec import PROTOCOL_VERSION
from comm.registry import RegistryServer
from comm.rpc import RpcClient, RpcError
from services.protocol import (
    Action,
    Assignment,
    AssignmentReply,
    CommitReply,
    CommitStep,
    Empty,
    LoadProgram,
    OptimizerSpec,
    OptimizerStepReply,
    OptimizerStepRequest,
    Reconnect,
    RunStep,
    StepReply,
)
from tests.harness.workers import WorkerProcess, registry_server, start_worker
from tests.multiproc.services import models
from tests.multiproc.services.compute_checks import (
    FACTORIES,
    GPIPE,
    MICROBATCHES,
    MODELS,
    ONE_F_ONE_B,
    assign_pipeline,
    call_stages,
    cut_spec,
    fetch,
    max_diff,
    parse_actions,
    reference,
    run_step,
)

pytestmark = pytest.mark.timeout(60)

JOB = "t-compute"
TOL = 1e-10
_names = itertools.count()


@pytest.fixture(scope="module")
def server() -> Iterator[RegistryServer]:
    with registry_server() as s:
        yield s


@pytest.fixture(scope="module")
def stages(server: RegistryServer) -> Iterator[list[str]]:
    """Two workers (started side by side); their addresses, stage 0 first."""
    started: dict[int, WorkerProcess | BaseException] = {}

    def start(i: int) -> None:
        try:
            # the job names a factory its module lacks too ("nope"): the worker reports it when assigned
            started[i] = start_worker(server.address, JOB, f"stage{i}",
                                      factories=[*FACTORIES, f"{MODELS}:nope"])
        except BaseException as exc:
            started[i] = exc

    threads = [threading.Thread(target=start, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    workers = [w for w in started.values() if isinstance(w, WorkerProcess)]
    try:
        assert len(workers) == 2, started
        yield [started[i].address for i in range(2)]  # type: ignore[union-attr]
    finally:
        for w in workers:
            w.stop()


def _pipeline(stages: list[str], server: RegistryServer, model: str, cut: int, num_cells: int,
              backend: str = "zmq") -> str:
    service = f"{model}-{backend}-{next(_names)}"
    assign_pipeline(stages, service, model=model, cut=cut, num_cells=num_cells, registry=server.address,
                    prefix=f"/cellmesh/{JOB}/pipe/{service}", backend=backend)
    return service


CASES = {
    "mlp-zmq": ("mlp", 3, 5, "zmq"),
    "mlp-gloo": ("mlp", 3, 5, "gloo"),
    "tuple-cut-zmq": ("skip_model", 1, 4, "zmq"),
    "dict-cut-with-int-tensor-zmq": ("skip_model", 2, 4, "zmq"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_gpipe_matches_single_process(stages: list[str], server: RegistryServer, case: str) -> None:
    model, cut, num_cells, backend = CASES[case]
    service = _pipeline(stages, server, model, cut, num_cells, backend)
    replies = run_step(stages, service, GPIPE)
    grads_ref, _, losses_ref = reference(model)
    grads = fetch(stages, service, "gradients")
    assert max_diff(grads, grads_ref) < TOL
    assert replies[0].losses == [] and len(replies[1].losses) == len(MICROBATCHES)
    assert max(abs(a - b) for a, b in zip(replies[1].losses, losses_ref, strict=True)) < TOL
    for stage, reply in enumerate(replies):
        actions = GPIPE[stage].split()
        assert reply.stage == stage and len(reply.starts) == len(reply.ends) == len(actions)
        assert all(s <= e for s, e in zip(reply.starts, reply.ends, strict=True))
        forwards = [(s, e) for a, s, e in zip(actions, reply.starts, reply.ends, strict=True)
                    if Action.parse(a).kind == "F"]
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(forwards)), "forwards overlap"
    assert_last_weights_after_the_send(replies[1], GPIPE[1])


def assert_last_weights_after_the_send(reply: StepReply, actions: str) -> None:
    """The last B's weight gradients are computed after its SEND_B posted the input gradients: the B's span
    covers the send's start ([Note: the last W after the send] in services/compute/executor.py; a gloo send
    ends when seen complete, which may be after them)."""
    index = {a: k for k, a in enumerate(actions.split())}
    last_b = max(k for a, k in index.items() if Action.parse(a).kind == "B")
    send = index[f"1SEND_B{Action.parse(actions.split()[last_b]).microbatch}"]
    assert reply.starts[last_b] <= reply.starts[send] <= reply.ends[last_b]


def test_tensors_that_need_no_grad_cross_without_gradient() -> None:
    spec = cut_spec(models.skip_model, 2)
    assert spec.structure == "dict"
    assert {t.name: (t.dtype, t.requires_grad) for t in spec.tensors} == {
        "h": ("float64", True), "skip": ("float64", True), "pos": ("int64", False)}


@pytest.mark.parametrize("backend", ["zmq", "gloo"])
def test_1f1b_matches_single_process_and_replays(stages: list[str], server: RegistryServer, backend: str
                                                 ) -> None:
    service = _pipeline(stages, server, "skip_model", 2, 4, backend)
    grads_ref, _, _ = reference("skip_model")
    for step in range(2):  # the second step zeroes first: replaying a step gives the same gradients
        replies = run_step(stages, service, ONE_F_ONE_B, step=step)
        assert max_diff(fetch(stages, service, "gradients"), grads_ref) < TOL
        assert_last_weights_after_the_send(replies[1], ONE_F_ONE_B[1])  # a replica alone


def test_a_commit_carried_by_the_next_step_applies_before_it(stages: list[str], server: RegistryServer
                                                              ) -> None:
    # steps 1 and 2 carry the commits of steps 0 and 1; a commit round applies step 2's:
    # three updates, each from its own step's gradients, as one process takes them
    service = _pipeline(stages, server, "mlp", 2, 5)
    spec = OptimizerSpec(name="Adam", kwargs={"lr": 0.01, "betas": [0.8, 0.99]})
    other = OptimizerSpec(name="SGD", kwargs={"lr": 0.1})
    run_step(stages, service, GPIPE, step=0)
    refused = call_stages(stages, service, "run_step", [
        RunStep(step=1, microbatches=MICROBATCHES, actions=parse_actions(GPIPE[s]), timeout_ms=20_000,
                commit=CommitStep(step=0, optimizer=spec))
        for s in range(2)], StepReply)
    assert all(isinstance(r, tuple) for r in refused)  # the first commit builds the optimizer
    mismatch = call_stages(stages, service, "run_step", [
        RunStep(step=2, microbatches=MICROBATCHES, actions=parse_actions(ONE_F_ONE_B[s]), timeout_ms=20_000,
                commit=CommitStep(step=1, optimizer=other))
        for s in range(2)], StepReply)
    assert all(isinstance(r, RpcError) and r.code == "bad_request" for r in mismatch), mismatch
    replies = call_stages(stages, service, "run_step", [
        RunStep(step=2, microbatches=MICROBATCHES, actions=parse_actions(ONE_F_ONE_B[s]), timeout_ms=20_000,
                commit=CommitStep(step=1, optimizer=spec))
        for s in range(2)], StepReply)
    assert all("optimizer" in [p.name for p in r[0].phases] for r in replies), replies
    commits = call_stages(stages, service, "commit", [CommitStep(step=2, optimizer=spec)] * 2, CommitReply)
    assert [r[0].optimizer_steps for r in commits] == [3, 3], commits
    _, params_ref, _ = reference("mlp", steps=3,
                                 optimizer=lambda ps: torch.optim.Adam(ps, lr=0.01, betas=(0.8, 0.99)))
    assert max_diff(fetch(stages, service, "parameters"), params_ref) < TOL


def test_optimizer_steps_match_single_process(stages: list[str], server: RegistryServer) -> None:
    service = _pipeline(stages, server, "mlp", 2, 5)
    spec = OptimizerSpec(name="Adam", kwargs={"lr": 0.01, "betas": [0.8, 0.99]})
    for step in range(3):
        run_step(stages, service, GPIPE if step % 2 == 0 else ONE_F_ONE_B, step=step)
        results = call_stages(stages, service, "optimizer_step", [OptimizerStepRequest(optimizer=spec)] * 2,
                              OptimizerStepReply)
        assert [r[0].steps for r in results] == [step + 1] * 2, results
    _, params_ref, _ = reference("mlp", steps=3,
                                 optimizer=lambda ps: torch.optim.Adam(ps, lr=0.01, betas=(0.8, 0.99)))
    assert max_diff(fetch(stages, service, "parameters"), params_ref) < TOL


def test_bad_input_then_valid(stages: list[str], server: RegistryServer) -> None:
    service = _pipeline(stages, server, "mlp", 3, 5)

    def envelope(**kw: object) -> bytes:
        body: dict[str, object] = dict(v=PROTOCOL_VERSION, id=9, service=service, method="run_step",
                                       body=dict(step=0, microbatches=[[0]], actions=[]), tensors=[])
        body.update(kw)
        data = msgpack.packb(body)
        assert isinstance(data, bytes)
        return data

    raw_cases = {
        "not msgpack": (b"\x93\xc1 junk", "bad_request", "msgpack"),
        "wrong version": (envelope(v=PROTOCOL_VERSION + 1), "bad_request", "version"),
        "unknown method": (envelope(method="teleport"), "unknown_method", "teleport"),
        "field of wrong type": (envelope(body=dict(step="0", microbatches=[[0]], actions=[
            {"stage": 0, "kind": "F", "microbatch": 0}])), "bad_request", "step"),
        "unknown action kind": (envelope(body=dict(step=0, microbatches=[[0]], actions=[
            {"stage": 0, "kind": "dance", "microbatch": 0}])), "bad_request", "actions.0.kind"),
    }
    with RpcClient(stages[0]) as c:
        for what, (frame, code, mentions) in raw_cases.items():
            reply = msgpack.unpackb(c.send_raw([frame])[0])
            assert reply["ok"] is False and reply["error"]["code"] == code, (what, reply)
            assert mentions in reply["error"]["message"], (what, reply)
    invalid_lists = {  # stage 0's list, and what the error must say: the action and the rule
        "0B0 0F0 0SEND_F0 0RECV_B0": "action #0 (0B0): 0F0 must come before it",
        "0F0 0SEND_F0 0RECV_B0 0B0 0F4 0SEND_F4": "action #4 (0F4): microbatch 4 is not one of the step's 4",
        GPIPE[1]: "action #0 (1RECV_F0): names stage 1",
        "0RECV_F0 0F0": "(0RECV_F0): stage 0 is the first stage; it has no previous stage",
        "0F0 0F0 0SEND_F0": "action #1 (0F0): repeats action #0",
        GPIPE[0].replace(" 0RECV_B2", ""): "action #13 (0B2): 0RECV_B2 must come before it",
    }
    with RpcClient(stages[0]) as c:
        for text, says in invalid_lists.items():
            with pytest.raises(RpcError) as err:
                c.call(service, "run_step", RunStep(step=0, microbatches=MICROBATCHES,
                                                    actions=parse_actions(text)), StepReply)
            assert err.value.code == "bad_request" and says in err.value.message, (text, err.value)
        with pytest.raises(RpcError, match="beyond the 32 samples"):
            c.call(service, "run_step", RunStep(step=0, microbatches=[[0, 99]] * 4,
                                                actions=parse_actions(GPIPE[0])), StepReply)
        with pytest.raises(RpcError, match=r"not a torch\.optim optimizer"):
            c.call(service, "optimizer_step", OptimizerStepRequest(optimizer=OptimizerSpec(name="Teleport")),
                   OptimizerStepReply)
        with pytest.raises(RpcError, match=r"model factory .*no attribute 'nope'") as bad_assign:
            c.call("worker", "assign", Assignment(service="broken", kind="compute", factory=f"{MODELS}:nope",
                                                  nodes=[0, 1], options=dict(stage=0, num_stages=1,
                                                  data=f"{MODELS}:regression", loss=f"{MODELS}:mse")),
                   AssignmentReply)
        assert bad_assign.value.code == "bad_request"
        with pytest.raises(RpcError, match=r"model factory 'tests\.multiproc\.coordinator\.models:mlp' "
                                           r"is not a factory of this worker's job") as foreign:
            c.call("worker", "assign", Assignment(service="broken", kind="compute",
                                                  factory="tests.multiproc.coordinator.models:mlp",
                                                  nodes=[0, 1], options=dict(stage=0, num_stages=1,
                                                  data=f"{MODELS}:regression", loss=f"{MODELS}:mse")),
                   AssignmentReply)
        assert foreign.value.code == "bad_request"
        with pytest.raises(RpcError, match=r"missing or invalid.*incoming"):
            c.call("worker", "assign", Assignment(service="broken", kind="compute", factory=f"{MODELS}:mlp",
                                                  nodes=[0, 1], options=dict(stage=1, num_stages=2,
                                                  registry="tcp://127.0.0.1:1", comm_prefix="/x",
                                                  data=f"{MODELS}:regression", loss=f"{MODELS}:mse")),
                   AssignmentReply)
    # the service was not disturbed: a valid step works and is right
    run_step(stages, service, GPIPE)
    assert max_diff(fetch(stages, service, "gradients"), reference("mlp")[0]) < TOL


def test_a_step_runs_the_program_it_names_and_one_the_stage_lacks_is_refused(
        stages: list[str], server: RegistryServer) -> None:
    service = _pipeline(stages, server, "mlp", 3, 5)
    named = [RunStep(step=0, microbatches=MICROBATCHES, program="train", timeout_ms=20_000)] * 2
    for r in call_stages(stages, service, "run_step", named, StepReply):  # nothing loaded yet
        assert isinstance(r, RpcError) and r.code == "bad_request", r
        assert "holds no program 'train'" in r.message and "load_program" in r.message, r
    with RpcClient(stages[0]) as c:
        junk = dict(program="train", num_microbatches=4, actions="junk")
        frame = msgpack.packb(dict(v=PROTOCOL_VERSION, id=3, service=service, method="load_program",
                                   body=junk, tensors=[]))
        reply = msgpack.unpackb(c.send_raw([frame])[0])
        assert reply["error"]["code"] == "bad_request" and "actions" in reply["error"]["message"], reply
        with pytest.raises(RpcError, match=r"program train: .*action #0 \(1RECV_F0\): names stage 1") as bad:
            c.call(service, "load_program", LoadProgram(program="train", num_microbatches=4,
                                                        actions=parse_actions(GPIPE[1])), Empty)
        assert bad.value.code == "bad_request"
        with pytest.raises(RpcError, match="holds no program 'train'"):  # the invalid one is not held
            c.call(service, "run_step", named[0], StepReply)
    loads = [LoadProgram(program="train", num_microbatches=4, actions=parse_actions(GPIPE[s]))
             for s in range(2)]
    loaded = call_stages(stages, service, "load_program", loads, Empty)
    assert all(not isinstance(r, Exception) for r in loaded), loaded
    with RpcClient(stages[0]) as c:
        with pytest.raises(RpcError, match="runs 4 microbatches, the step brings 2"):
            c.call(service, "run_step", RunStep(step=0, microbatches=MICROBATCHES[:2], program="train"),
                   StepReply)
        frame = msgpack.packb(dict(v=PROTOCOL_VERSION, id=4, service=service, method="run_step", tensors=[],
                                   body=dict(step=0, microbatches=MICROBATCHES, program="train",
                                             actions=[{"stage": 0, "kind": "F", "microbatch": 0}])))
        reply = msgpack.unpackb(c.send_raw([frame])[0])
        error = reply["error"]
        assert error["code"] == "bad_request" and "takes ['actions'] from it" in error["message"], reply
    for _ in range(2):  # the service kept serving: the program runs, twice, as one process computes it
        replies = [r for r, _ in call_stages(stages, service, "run_step", named, StepReply)]
        assert [len(r.starts) for r in replies] == [len(GPIPE[s].split()) for s in range(2)]
        grads_ref, _, losses_ref = reference("mlp")
        assert max_diff(fetch(stages, service, "gradients"), grads_ref) < TOL
        assert max(abs(a - b) for a, b in zip(replies[1].losses, losses_ref, strict=True)) < TOL


def test_boundary_mismatch_names_stage_microbatch_and_tensor(stages: list[str], server: RegistryServer
                                                             ) -> None:
    spec = cut_spec(models.mlp, 3)
    wrong = spec.model_copy(update={"tensors": [spec.tensors[0].model_copy(update={"shape": [4, 11]})]})
    service = f"mismatch-{next(_names)}"
    assign_pipeline(stages, service, model="mlp", cut=3, num_cells=5, registry=server.address,
                    prefix=f"/cellmesh/{JOB}/pipe/{service}", spec=wrong)
    requests = [RunStep(step=0, microbatches=MICROBATCHES, actions=parse_actions(GPIPE[s]), timeout_ms=1500)
                for s in range(2)]
    results = call_stages(stages, service, "run_step", requests, StepReply)
    assert all(isinstance(r, RpcError) and r.code == "step_failed" for r in results), results
    expected = "stage 0 microbatch 0 output: tensor 'x': expected float64[4, 11] requires_grad=True, got "
    assert expected + "float64[4, 10]" in str(results[0])
    assert "microbatch 0's activations from stage 0" in str(results[1])


def test_abandoned_step_is_replayed_after_reconnect(stages: list[str], server: RegistryServer) -> None:
    service = _pipeline(stages, server, "mlp", 3, 5)
    start = time.monotonic()
    with RpcClient(stages[1], timeout=timedelta(seconds=20)) as c:  # stage 0 never runs this step
        with pytest.raises(RpcError) as err:
            c.call(service, "run_step", RunStep(step=0, microbatches=MICROBATCHES,
                                                actions=parse_actions(GPIPE[1]), timeout_ms=1000), StepReply)
        assert err.value.code == "step_failed" and "from stage 0" in err.value.message
        assert time.monotonic() - start < 10
        with pytest.raises(RpcError) as poisoned:
            c.call(service, "run_step", RunStep(step=0, microbatches=MICROBATCHES,
                                                actions=parse_actions(GPIPE[1])), StepReply)
        assert poisoned.value.code == "comm_failed"
    fresh = Reconnect(comm_prefix=f"/cellmesh/{JOB}/pipe/{service}/generation1")
    results = call_stages(stages, service, "reconnect", [fresh, fresh], Empty)
    assert all(not isinstance(r, Exception) for r in results), results
    replies = run_step(stages, service, GPIPE)
    grads_ref, _, losses_ref = reference("mlp")
    assert max_diff(fetch(stages, service, "gradients"), grads_ref) < TOL
    assert max(abs(a - b) for a, b in zip(replies[1].losses, losses_ref, strict=True)) < TOL
