"""The push/pull parameter service: shards in real worker processes, replicas as threads here.

Correctness is measured against plain PyTorch in this process: two replicas on a
synchronous service (1 and 2 shards) must end where one process training on the whole
global batch ends. The asynchronous tests check the staleness bound against an
independent count kept by the replicas themselves.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import msgpack
import pytest
import torch
from torch import nn

from comm.codec import PROTOCOL_VERSION
from comm.registry import RegistryServer
from comm.rpc import RpcClient, RpcError
from comm.sockets import CHUNK_BYTES
from services.params.client import PushPullClient, ShardRef, setup_shards
from services.params.sharding import join_pieces, piece_slices, plan_shards, split_pieces
from services.params.store import ParamStore
from services.protocol import (
    Assignment,
    AssignmentReply,
    Empty,
    OptimizerSpec,
    ParamInfo,
    PullReply,
    PullRequest,
    PushReply,
    PushRequest,
    ShardInfo,
    ShardSetup,
)
from tests.harness.workers import WorkerProcess, registry_server, start_worker

JOB = "t-param-server"
STEPS = 5
WAIT = timedelta(seconds=20)
_names = itertools.count()


# -- fixtures ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[RegistryServer]:
    with registry_server() as s:
        yield s


@pytest.fixture(scope="module")
def workers(server: RegistryServer) -> Iterator[list[WorkerProcess]]:
    with ThreadPoolExecutor(2) as pool:
        started = list(pool.map(lambda name: start_worker(server.address, JOB, name), ["ps-a", "ps-b"]))
    yield started
    for w in started:
        w.stop()


@pytest.fixture
def new_shards(workers: list[WorkerProcess]) -> Callable[[int], list[ShardRef]]:
    """Assign ``n`` fresh parameter services, alternating between the two workers."""

    def make(n: int) -> list[ShardRef]:
        refs = []
        for i in range(n):
            worker = workers[i % len(workers)]
            name = f"ps{next(_names)}"
            with RpcClient(worker.address, timeout=WAIT) as c:
                reply, _ = c.call("worker", "assign", Assignment(service=name, kind="param_server"),
                                  AssignmentReply)
            refs.append(ShardRef(reply.address, name))
        return refs

    return make


# -- the model and its single-process reference ----------------------------------------


def make_mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).double()


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return (torch.randn(32, 8, generator=g, dtype=torch.float64),
            torch.randn(32, 4, generator=g, dtype=torch.float64))


OPTIMIZERS = {
    "SGD": OptimizerSpec(name="SGD", kwargs={"lr": 0.1, "momentum": 0.9}),
    "Adam": OptimizerSpec(name="Adam", kwargs={"lr": 0.01, "betas": [0.9, 0.99], "weight_decay": 0.01}),
}


def reference(spec: OptimizerSpec) -> dict[str, torch.Tensor]:
    model = make_mlp(0)
    opt = getattr(torch.optim, spec.name)(model.parameters(), **spec.kwargs)
    for step in range(STEPS):
        x, y = global_batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


PART_BYTES = 600  # parts of a few parameters each: pushes and pulls travel in several messages


def run_replica(shards: list[ShardRef], replica: int, replicas: int) -> None:
    model = make_mlp(100 + replica)  # a different init: the pull must overwrite it
    params = dict(model.named_parameters())
    fused = replica % 2 == 1  # odd replicas push and pull in one call
    with PushPullClient(shards, replica, timeout=WAIT, part_bytes=PART_BYTES) as client:
        assert client.pull(params) == 0
        for step in range(STEPS):
            x, y = global_batch(step)
            half = x.shape[0] // replicas
            rows = slice(replica * half, (replica + 1) * half)
            model.zero_grad()
            nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
            grads = {n: p.grad for n, p in params.items()}
            if fused:
                assert client.push_pull(grads, step, params, min_version=step + 1) == step + 1
            else:
                client.push(grads, step)
                assert client.pull(params, min_version=step + 1) == step + 1


def in_threads(fns: list[Callable[[], None]]) -> None:
    with ThreadPoolExecutor(len(fns)) as pool:
        for future in [pool.submit(fn) for fn in fns]:
            future.result(timeout=60)


# -- sharding (pure) ---------------------------------------------------------------------


def test_plan_is_balanced_largest_first_and_deterministic() -> None:
    sizes = {"a": 10, "b": 70, "c": 30, "d": 30, "e": 20, "f": 0}
    plan = plan_shards(sizes, 2)
    # largest first, each to the lighter shard: b->0, c->1, d->1, e->1, a->0, f->0 (a tie: the lower index)
    assert plan.shards == (("a", "b", "f"), ("c", "d", "e"))  # names keep the input order
    assert plan.loads == (80, 80)
    reordered = plan_shards(dict(reversed(list(sizes.items()))), 2)
    assert [set(s) for s in reordered.shards] == [set(s) for s in plan.shards]
    assert plan.owner("e") == 1
    assert plan_shards(sizes, 1).shards == (tuple(sizes),)
    with pytest.raises(ValueError, match="num_shards"):
        plan_shards(sizes, 0)


def test_pieces_round_trip() -> None:
    per_piece = CHUNK_BYTES // 8
    t = torch.arange(2 * per_piece + 1000, dtype=torch.float64)  # a bit over two frames -> 3 pieces
    pieces = split_pieces("w", t)
    assert [n for n, _ in pieces] == ["w#0", "w#1", "w#2"]
    assert all(p.numel() * 8 <= CHUNK_BYTES for _, p in pieces)
    joined = join_pieces(dict(pieces))["w"]
    assert torch.equal(torch.cat([joined[k] for k in range(3)]), t.view(-1))
    assert piece_slices(0, torch.float32) == [slice(0, 0)]
    with pytest.raises(ValueError, match="not a parameter piece"):
        join_pieces({"w": t})


def test_an_update_never_changes_memory_a_pull_reply_still_reads() -> None:
    """[Note: pull replies view the parameters]: a parameter still on the wire moves first."""
    w = torch.arange(300_000, dtype=torch.float32)
    store = ParamStore([ParamInfo(name="w", dtype="float32", shape=[300_000])], dict(split_pieces("w", w)),
                       OptimizerSpec(name="SGD", kwargs={"lr": 1.0}))
    grads = store.parse(dict(split_pieces("w", torch.ones(300_000))))
    store.step(store.accumulate(grads, complete_at=1), divisor=1)
    store.finish_round(divisor=1)
    assert store.moves == 0, "nothing was on the wire: the update is in place"
    on_the_wire = store.pieces(["w"])  # what a queued pull reply's frames hold
    store.step(store.accumulate(grads, complete_at=1), divisor=1)
    store.finish_round(divisor=1)
    assert store.moves == 1
    assert torch.equal(torch.cat([p for _, p in on_the_wire]), w - 1), "the queued reply was changed"
    del on_the_wire
    assert torch.equal(torch.cat([p for _, p in store.pieces(["w"])]), w - 2)


# -- synchronous mode against one process ---------------------------------------------


@pytest.mark.parametrize("num_shards", [1, 2])
@pytest.mark.parametrize("optimizer", ["SGD", "Adam"])
def test_sync_two_replicas_match_one_process(new_shards: Callable[[int], list[ShardRef]],
                                             optimizer: str, num_shards: int) -> None:
    spec = OPTIMIZERS[optimizer]
    shards = new_shards(num_shards)
    initial = {n: p.detach().clone() for n, p in make_mlp(0).named_parameters()}
    plan = setup_shards(shards, initial, mode="sync", replicas=2, optimizer=spec, timeout=WAIT)
    assert all(plan.shards) and sorted(itertools.chain(*plan.shards)) == sorted(initial)
    in_threads([functools.partial(run_replica, shards, r, 2) for r in range(2)])
    final = {n: torch.zeros_like(t) for n, t in initial.items()}
    with PushPullClient(shards, 0, timeout=WAIT) as client:
        assert client.pull(final, min_version=STEPS) == STEPS
    expected = reference(spec)
    worst = max((final[n] - expected[n]).abs().max().item() for n in expected)
    assert worst < 1e-10, f"{optimizer}, {num_shards} shards: max abs difference {worst:.3g}"
    moved = max((final[n] - initial[n]).abs().max().item() for n in expected)
    assert moved > 1e-3, "training did not change the parameters"


# -- asynchronous mode: the staleness bound -------------------------------------------


def run_async(shards: list[ShardRef], staleness: int, steps: int = 10) -> list[tuple[int, int, list[int]]]:
    """A fast replica 0 and a slow replica 1; returns (step, slow pushes begun, clocks) per fast pull."""
    slow_begun = [0]  # written by the slow replica before each push: an independent count
    records: list[tuple[int, int, list[int]]] = []

    def replica(r: int) -> None:
        model = make_mlp(0)
        params = dict(model.named_parameters())
        with PushPullClient(shards, r, timeout=WAIT, part_bytes=PART_BYTES) as client:
            for step in range(steps):
                client.pull(params)
                if r == 0:
                    reply = client.last_pull[0]
                    assert reply is not None
                    records.append((step, slow_begun[0], list(reply.clocks)))
                x, y = global_batch(step)
                model.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                if r == 1:
                    time.sleep(0.05)
                    slow_begun[0] = step + 1
                client.push({n: p.grad for n, p in params.items()}, step)

    in_threads([lambda: replica(0), lambda: replica(1)])
    return records


@pytest.mark.parametrize("staleness", [0, 2])
def test_async_staleness_bound_holds_under_a_slow_replica(new_shards: Callable[[int], list[ShardRef]],
                                                          staleness: int) -> None:
    shards = new_shards(1)
    initial = {n: p.detach().clone() for n, p in make_mlp(0).named_parameters()}
    setup_shards(shards, initial, mode="async", replicas=2, staleness=staleness,
                 optimizer=OptimizerSpec(name="SGD", kwargs={"lr": 0.01}), timeout=WAIT)
    records = run_async(shards, staleness)
    for step, slow_begun, clocks in records:
        assert clocks[0] == step, (step, clocks)
        assert step - slow_begun <= staleness, f"fast replica pulled for step {step} with the slow one at " \
                                               f"{slow_begun} pushes (bound {staleness}): {records}"
        assert step - min(clocks) <= staleness, records
    lead = max(step - slow for step, slow, _ in records)
    assert lead == staleness, f"the fast replica never reached the bound: {records}"
    with RpcClient(shards[0].address, timeout=WAIT) as c:
        info, _ = c.call(shards[0].service, "info", Empty(), ShardInfo)
    assert info.version == 20 and info.clocks == [10, 10]  # async: every push is one update


def test_async_without_a_tight_bound_runs_ahead(new_shards: Callable[[int], list[ShardRef]]) -> None:
    """The check above is meaningful: with a loose bound the fast replica does run ahead."""
    shards = new_shards(1)
    initial = {n: p.detach().clone() for n, p in make_mlp(0).named_parameters()}
    setup_shards(shards, initial, mode="async", replicas=2, staleness=1000,
                 optimizer=OptimizerSpec(name="SGD", kwargs={"lr": 0.01}), timeout=WAIT)
    records = run_async(shards, 1000)
    assert max(step - slow for step, slow, _ in records) >= 5, records


# -- idempotence, closed steps, ownership ------------------------------------------------


def _push(c: RpcClient, shard: ShardRef, replica: int, step: int, seq: int,
          grads: dict[str, torch.Tensor], timeout: timedelta = WAIT, part: int = 0, parts: int = 1
          ) -> PushReply:
    pieces = [p for n, t in grads.items() for p in split_pieces(n, t)]
    request = PushRequest(replica=replica, step=step, seq=seq, part=part, parts=parts)
    reply, _ = c.call(shard.service, "push", request, PushReply, tensors=pieces, timeout=timeout)
    return reply


def _pull(c: RpcClient, shard: ShardRef, min_version: int = 0, timeout_ms: int = 10_000
          ) -> tuple[PullReply, dict[str, torch.Tensor]]:
    reply, tensors = c.call(shard.service, "pull", PullRequest(replica=0, min_version=min_version,
                                                                timeout_ms=timeout_ms), PullReply)
    return reply, {n: torch.cat([p[k] for k in sorted(p)]) for n, p in join_pieces(tensors).items()}


def test_duplicates_closed_steps_and_foreign_parameters(new_shards: Callable[[int], list[ShardRef]]) -> None:
    (shard,) = new_shards(1)
    zeros = torch.zeros(4, dtype=torch.float64)
    setup_shards([shard], {"w": zeros}, mode="sync", replicas=2,
                 optimizer=OptimizerSpec(name="SGD", kwargs={"lr": 1.0}), timeout=WAIT)
    one, three = {"w": zeros + 1}, {"w": zeros + 3}
    with RpcClient(shard.address, timeout=WAIT) as c:
        assert _push(c, shard, 0, 0, 0, one) == PushReply(version=0, duplicate=False)
        assert _push(c, shard, 0, 0, 0, one) == PushReply(version=0, duplicate=True)
        with pytest.raises(RpcError, match="already pushed step 0 with seq 0") as second:
            _push(c, shard, 0, 0, 1, one)
        assert second.value.code == "bad_request"
        assert _push(c, shard, 1, 0, 0, three) == PushReply(version=1, duplicate=False)  # closes step 0
        assert _push(c, shard, 1, 0, 0, three) == PushReply(version=1, duplicate=True)  # re-sent late
        with pytest.raises(RpcError, match="step 0 is closed") as closed:
            _push(c, shard, 0, 0, 7, one)
        assert closed.value.code == "step_closed"
        with pytest.raises(RpcError, match="not open yet") as ahead:
            _push(c, shard, 0, 3, 8, one)
        assert ahead.value.code == "step_ahead"
        not_held = rf"shard '{shard.service}' does not hold parameter \['ghost'\]"
        with pytest.raises(RpcError, match=not_held) as foreign:
            _push(c, shard, 0, 1, 9, {"w": zeros + 5, "ghost": zeros})
        assert foreign.value.code == "not_owner"
        reply, values = _pull(c, shard, min_version=1)
        assert reply.version == 1
        assert torch.equal(values["w"], zeros - 2), "step 0 must be applied once: w = 0 - 1.0 * mean(1, 3)"

        # a push whose answer timed out is re-sent with the same (replica, step, seq): applied once
        with pytest.raises(TimeoutError):
            _push(c, shard, 0, 1, 10, one, timeout=timedelta(0))
        assert _push(c, shard, 0, 1, 10, one).duplicate
        assert not _push(c, shard, 1, 1, 11, three).duplicate
        reply, values = _pull(c, shard, min_version=2)
        assert reply.version == 2 and torch.equal(values["w"], zeros - 4)


def test_client_resends_after_a_timeout_and_the_push_is_applied_once(
        new_shards: Callable[[int], list[ShardRef]]) -> None:
    shards = new_shards(2)
    params = {"w": torch.zeros(3, dtype=torch.float64), "v": torch.zeros(2, dtype=torch.float64)}
    setup_shards(shards, params, mode="sync", replicas=1,
                 optimizer=OptimizerSpec(name="SGD", kwargs={"lr": 1.0}), timeout=WAIT)
    grads = {n: torch.ones_like(t) for n, t in params.items()}
    with PushPullClient(shards, 0, timeout=WAIT, retries=2) as client:
        with pytest.raises(TimeoutError, match=r"no reply in 3 attempts"):
            client.push(grads, 0, timeout=timedelta(0))  # every attempt gives up at once: sent 3 times
        into = {n: torch.empty_like(t) for n, t in params.items()}
        assert client.pull(into, min_version=1) == 1
        client.push(grads, 1)  # the client goes on with the next step
        assert client.pull(into, min_version=2) == 2
    assert all(torch.equal(into[n], -2 * torch.ones_like(t)) for n, t in params.items()), into
    for shard in shards:
        with RpcClient(shard.address, timeout=WAIT) as c:
            assert c.call(shard.service, "info", Empty(), ShardInfo)[0].version == 2


def test_a_push_in_parts(new_shards: Callable[[int], list[ShardRef]]) -> None:
    sync, asyn = new_shards(2)
    zeros = torch.zeros(3, dtype=torch.float64)
    sgd = OptimizerSpec(name="SGD", kwargs={"lr": 1.0})
    setup_shards([sync], {"w": zeros, "v": zeros}, mode="sync", replicas=1, optimizer=sgd, timeout=WAIT)
    setup_shards([asyn], {"w": zeros, "v": zeros}, mode="async", replicas=1, optimizer=sgd, timeout=WAIT)
    with RpcClient(sync.address, timeout=WAIT) as c:
        assert _push(c, sync, 0, 0, 0, {"w": zeros + 1}, part=0, parts=2) == PushReply(version=0)
        assert _push(c, sync, 0, 0, 0, {"w": zeros + 1}, part=0, parts=2).duplicate
        with pytest.raises(RpcError, match="came in 2 parts; this part says 3") as mismatch:
            _push(c, sync, 0, 0, 0, {"v": zeros + 2}, part=1, parts=3)
        assert mismatch.value.code == "bad_request"
        assert _push(c, sync, 0, 0, 0, {"v": zeros + 2}, part=1, parts=2) == PushReply(version=1)
        assert _push(c, sync, 0, 0, 0, {"v": zeros + 2}, part=1, parts=2).duplicate
        _, values = _pull(c, sync, min_version=1)
        assert torch.equal(values["w"], zeros - 1) and torch.equal(values["v"], zeros - 2)
    with RpcClient(asyn.address, timeout=WAIT) as c:
        assert _push(c, asyn, 0, 0, 0, {"w": zeros + 1}, part=0, parts=2) == PushReply(version=0)
        reply, values = _pull(c, asyn)  # async applies each part on arrival: visible, not yet counted
        assert reply.version == 0 and reply.clocks == [0] and torch.equal(values["w"], zeros - 1)
        with pytest.raises(RpcError, match=r"push of step 0 \(seq 0\) still lacks parts \[1\]"):
            _push(c, asyn, 0, 1, 1, {"w": zeros + 1})
        assert _push(c, asyn, 0, 0, 0, {"v": zeros + 2}, part=1, parts=2) == PushReply(version=1)
        reply, values = _pull(c, asyn)
        assert reply.clocks == [1] and torch.equal(values["v"], zeros - 2)
        assert torch.equal(values["w"], zeros - 1)


def test_pull_timeout_names_the_missing_replicas(new_shards: Callable[[int], list[ShardRef]]) -> None:
    (shard,) = new_shards(1)
    setup_shards([shard], {"w": torch.zeros(2)}, mode="sync", replicas=3,
                 optimizer=OptimizerSpec(name="SGD", kwargs={"lr": 1.0}), timeout=WAIT)
    with RpcClient(shard.address, timeout=WAIT) as c:
        _push(c, shard, 1, 0, 0, {"w": torch.ones(2)})
        start = time.monotonic()
        with pytest.raises(RpcError, match=r"step 0 still lacks pushes from replicas \[0, 2\]") as err:
            _pull(c, shard, min_version=1, timeout_ms=300)
        assert err.value.code == "timeout" and 0.25 < time.monotonic() - start < 5


# -- setup and bad input -----------------------------------------------------------------


def test_setup_is_checked(new_shards: Callable[[int], list[ShardRef]]) -> None:
    (shard,) = new_shards(1)
    w = torch.zeros(3)
    infos = [ParamInfo(name="w", dtype="float32", shape=[3])]
    with RpcClient(shard.address, timeout=WAIT) as c:
        info, _ = c.call(shard.service, "info", Empty(), ShardInfo)
        assert not info.ready
        with pytest.raises(RpcError, match="send setup first") as early:
            _pull(c, shard)
        assert early.value.code == "not_ready"
        refused: list[tuple[str, dict[str, float | int | bool | list[float]], str]] = [
            ("os.system", {}, "unknown optimizer"), ("Optimizer", {}, "unknown"), ("LBFGS", {}, "closure"),
            ("SGD", {"lr": -1.0}, "Invalid learning rate"), ("SGD", {"lr": 0.1, "nope": 1}, "nope")]
        for name, kwargs, reason in refused:
            setup = ShardSetup(mode="sync", replicas=1, optimizer=OptimizerSpec(name=name, kwargs=kwargs),
                               params=infos)
            with pytest.raises(RpcError, match=reason) as bad:
                c.call(shard.service, "setup", setup, ShardInfo, tensors=split_pieces("w", w))
            assert bad.value.code == "bad_request"
        good = ShardSetup(mode="sync", replicas=1, optimizer=OptimizerSpec(name="SGD", kwargs={"lr": 0.1}),
                          params=infos)
        with pytest.raises(RpcError, match=r"expected pieces 0\.\.0"):
            c.call(shard.service, "setup", good, ShardInfo)  # values missing
        info, _ = c.call(shard.service, "setup", good, ShardInfo, tensors=split_pieces("w", w))
        assert info.ready and info.version == 0 and info.params == infos
        with pytest.raises(RpcError) as again:
            c.call(shard.service, "setup", good, ShardInfo, tensors=split_pieces("w", w))
        assert again.value.code == "already_setup"


def test_bad_input_then_valid(new_shards: Callable[[int], list[ShardRef]]) -> None:
    (shard,) = new_shards(1)
    setup_shards([shard], {"w": torch.zeros(4)}, mode="sync", replicas=1,
                 optimizer=OptimizerSpec(name="SGD", kwargs={"lr": 1.0}), timeout=WAIT)

    def envelope(**kw: Any) -> bytes:
        body: dict[str, Any] = dict(v=PROTOCOL_VERSION, id=5, service=shard.service, method="push",
                                    body=dict(replica=0, step=0, seq=0), tensors=[])
        body.update(kw)
        data = msgpack.packb(body)
        assert isinstance(data, bytes)
        return data

    piece = torch.ones(4).numpy().tobytes()
    cases: dict[str, tuple[list[bytes], str, str]] = {
        "not msgpack": ([b"\xc1\xc1 junk"], "bad_request", "not msgpack"),
        "wrong version": ([envelope(v=PROTOCOL_VERSION + 1)], "bad_request", "protocol version"),
        "unknown method": ([envelope(method="teleport")], "unknown_method", "teleport"),
        "field of wrong type": ([envelope(body=dict(replica=0, step="0", seq=0))], "bad_request", "step"),
        "extra field": ([envelope(body=dict(replica=0, step=0, seq=0, lr=5))], "bad_request", "lr"),
        "frames missing": ([envelope(tensors=[dict(name="w#0", dtype="float32", shape=[4], frames=1)])],
                           "bad_request", "frames"),
        "not a piece": ([envelope(tensors=[dict(name="w", dtype="float32", shape=[4], frames=1)]), piece],
                        "bad_request", "not a parameter piece"),
        "wrong dtype": ([envelope(tensors=[dict(name="w#0", dtype="int32", shape=[4], frames=1)]), piece],
                        "bad_request", "expected torch.float32"),
        "short piece": ([envelope(tensors=[dict(name="w#0", dtype="float32", shape=[2], frames=1)]),
                         piece[:8]], "bad_request", "expected torch.float32[4]"),
        "foreign parameter": ([envelope(tensors=[dict(name="v#0", dtype="float32", shape=[4], frames=1)]),
                               piece], "not_owner", "'v'"),
        "replica out of range": ([envelope(body=dict(replica=1, step=0, seq=0))], "bad_request",
                                 "replicas 0..0"),
        "part out of range": ([envelope(body=dict(replica=0, step=0, seq=0, part=2, parts=2))], "bad_request",
                              "part 2 is not below parts 2"),
    }
    with RpcClient(shard.address, timeout=WAIT) as c:
        for what, (frames, code, text) in cases.items():
            reply = msgpack.unpackb(c.send_raw(frames)[0])
            assert reply["ok"] is False and reply["error"]["code"] == code, (what, reply)
            assert text in reply["error"]["message"], (what, reply)
        assert not _push(c, shard, 0, 0, 0, {"w": torch.ones(4)}).duplicate  # nothing above was taken
        reply, values = _pull(c, shard, min_version=1)
    assert reply.version == 1 and torch.equal(values["w"], -torch.ones(4))


def test_client_refuses_unknown_names_and_wrong_shapes(new_shards: Callable[[int], list[ShardRef]]) -> None:
    shards = new_shards(2)
    params = {"a": torch.zeros(3), "b": torch.zeros(2, 2)}
    setup_shards(shards, params, mode="sync", replicas=1,
                 optimizer=OptimizerSpec(name="SGD", kwargs={"lr": 1.0}), timeout=WAIT)
    with PushPullClient(shards, 0, timeout=WAIT) as client:
        assert client.owner == {"b": 0, "a": 1}
        with pytest.raises(KeyError, match="ghost"):
            client.push({"ghost": torch.zeros(1)}, 0)
        with pytest.raises(ValueError, match="shape"):
            client.pull({"a": torch.zeros(4)})
        client.push({"a": torch.ones(3), "b": None}, 0)  # b has no gradient: skipped by the optimizer
        into = {"a": torch.empty(3), "b": torch.empty(2, 2).t()}  # a non-contiguous destination works too
        assert client.pull(into, min_version=1) == 1
        start = time.monotonic()
        with pytest.raises(RpcError, match="not open yet") as ahead:
            client.push_pull({"a": torch.ones(3)}, 7, into, min_version=8)  # the pulls are not awaited
        assert ahead.value.code == "step_ahead" and time.monotonic() - start < 5
        assert client.pull(into, min_version=1) == 1
    assert torch.equal(into["a"], -torch.ones(3)) and torch.equal(into["b"], torch.zeros(2, 2))
