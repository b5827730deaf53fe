"""Conformance checks of the Communicator contract, run inside rank processes.

Each function runs on every rank of a :class:`tests.harness.procs.RankGroup` as
``check(communicator, **kwargs)`` and returns a list of failure descriptions (empty when
all is well), so one command sweeps a whole matrix and reports every miss at once.

References are computed independently on each rank: every rank regenerates every
rank's input from the seed (``torch.Generator().manual_seed(seed * 1000 + rank)``) and
reduces them itself, in float64 for floating-point dtypes and int64 for integers,
then compares. Tolerances: exact for data movement, MAX/MIN and int64; for SUM/MEAN
of floats the bound is ``eps(dtype) * (world_size + 2) * sum_r |x_r|`` element-wise,
which covers any summation order plus the final rounding (and the division of MEAN).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch

from comm.base import Communicator, ReduceOp, Work
from comm.errors import CommError, CommTimeoutError

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
}
SIZES = (0, 1, 4097)
LAYOUTS = ("contiguous", "strided")
_SENTINEL = 7


# -- inputs and comparisons -------------------------------------------------------------


def _device(comm: Communicator) -> torch.device:
    if comm.backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _input(seed: int, rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s input for case ``seed`` (CPU); the same on every process."""
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    if dtype.is_floating_point:
        return torch.randn(n, generator=gen, dtype=torch.float64).to(dtype)
    return torch.randint(-(1 << 40), 1 << 40, (n,), generator=gen, dtype=torch.int64)


class _Strided:
    """A tensor laid out as requested; strided ones are column 1 of an (n, 2) buffer."""

    def __init__(self, values: torch.Tensor, layout: str, device: torch.device) -> None:
        self.layout = layout
        if layout == "contiguous":
            self.holder = values.to(device).clone()
            self.view = self.holder
        else:
            self.holder = torch.full((values.numel(), 2), _SENTINEL, dtype=values.dtype, device=device)
            self.holder[:, 1] = values.to(device)
            self.view = self.holder[:, 1]

    def neighbours_intact(self) -> bool:
        """The elements between the strided ones were not written."""
        if self.layout == "contiguous":
            return True
        return bool((self.holder[:, 0] == _SENTINEL).all())


def _empty(n: int, dtype: torch.dtype, layout: str, device: torch.device) -> _Strided:
    return _Strided(torch.zeros(n, dtype=dtype), layout, device)


def _cases(sizes: Sequence[int] = SIZES) -> Iterator[tuple[int, str, torch.dtype, int, str]]:
    for index, (dname, n, layout) in enumerate(itertools.product(DTYPES, sizes, LAYOUTS)):
        yield index, dname, DTYPES[dname], n, layout


def _exact(what: str, got: torch.Tensor, want: torch.Tensor) -> str | None:
    got = got.detach().cpu()
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{what}: got {tuple(got.shape)} {got.dtype}, want {tuple(want.shape)} {want.dtype}"
    if torch.equal(got, want):
        return None
    bad = (got != want).nonzero()
    i = tuple(int(v) for v in bad[0])
    return (f"{what}: {bad.shape[0]} elements differ, first at {i}: "
            f"got {got[i].item()!r}, want {want[i].item()!r}")


def _close(what: str, got: torch.Tensor, want64: torch.Tensor, bound: torch.Tensor) -> str | None:
    got = got.detach().cpu()
    if got.shape != want64.shape:
        return f"{what}: got shape {tuple(got.shape)}, want {tuple(want64.shape)}"
    err = (got.double() - want64).abs()
    bad = (err > bound).nonzero()
    if bad.shape[0] == 0:
        return None
    i = int(bad[0, 0])
    return (f"{what}: {bad.shape[0]} elements off, first at {i}: got {got[i].item()!r}, "
            f"want {want64[i].item()!r} (|err| {err[i].item():.3g} > bound {bound[i].item():.3g})")


Checker = Callable[[str, torch.Tensor], "str | None"]


def _reference(op: ReduceOp, inputs: list[torch.Tensor], dtype: torch.dtype) -> Checker:
    """A checker of a reduction's result against the independent reference."""
    world = len(inputs)
    if op in (ReduceOp.MAX, ReduceOp.MIN) or not dtype.is_floating_point:
        stacked = torch.stack(inputs)
        if op is ReduceOp.MAX:
            exact = stacked.max(0).values
        elif op is ReduceOp.MIN:
            exact = stacked.min(0).values
        else:
            exact = stacked.sum(0)  # int64: exact
        return lambda what, got: _exact(what, got, exact)
    stacked64 = torch.stack([t.double() for t in inputs])
    want = stacked64.sum(0)
    bound = torch.finfo(dtype).eps * (world + 2) * stacked64.abs().sum(0)
    if op is ReduceOp.MEAN:
        want, bound = want / world, bound / world
    bound = bound + torch.finfo(torch.float64).tiny
    return lambda what, got: _close(what, got, want, bound)


def _label(op: str, dname: str, n: int, layout: str) -> str:
    return f"{op} {dname} n={n} {layout}"


def _attempt(failures: list[str], label: str, fn: Callable[..., object], *args: Any, **kwargs: Any) -> None:
    """Call ``fn`` (waiting on the Work it returns); a non-Comm error is recorded as a failure."""
    try:
        result = fn(*args, **kwargs)
        if isinstance(result, Work):
            result.wait()
    except CommError:
        raise  # the communicator is unusable: stop this sweep
    except Exception as exc:
        failures.append(f"{label}: raised {type(exc).__name__}: {exc}")


# -- collectives ----------------------------------------------------------------------------


def check_all_reduce(comm: Communicator, *, seed: int, ops: Sequence[str] = ("sum", "mean", "max", "min"),
                     async_op: bool = False) -> list[str]:
    failures: list[str] = []
    dev, world, me = _device(comm), comm.world_size, comm.rank
    for op_name in ops:
        op = ReduceOp(op_name)
        for index, dname, dtype, n, layout in _cases():
            label = _label(f"all_reduce[{op_name}{' async' if async_op else ''}]", dname, n, layout)
            case_seed = seed * 1000 + index
            inputs = [_input(case_seed, r, n, dtype) for r in range(world)]
            if op is ReduceOp.MEAN and not dtype.is_floating_point:
                t = _Strided(inputs[me], layout, dev)
                try:
                    comm.all_reduce(t.view, op)
                    failures.append(f"{label}: MEAN of int64 did not raise ValueError")
                except ValueError:
                    pass
                continue
            check = _reference(op, inputs, dtype)
            t = _Strided(inputs[me], layout, dev)
            _attempt(failures, label, comm.all_reduce, t.view, op, async_op=async_op)
            problem = check(label, t.view)
            if problem:
                failures.append(problem)
            if not t.neighbours_intact():
                failures.append(f"{label}: wrote outside the strided view")
    return failures


def check_broadcast(comm: Communicator, *, seed: int) -> list[str]:
    failures: list[str] = []
    dev, world, me = _device(comm), comm.world_size, comm.rank
    for src in range(world):
        for index, dname, dtype, n, layout in _cases():
            label = _label(f"broadcast[src={src}]", dname, n, layout)
            case_seed = seed * 1000 + index * 10 + src
            want = _input(case_seed, src, n, dtype)
            t = _Strided(_input(case_seed, me, n, dtype), layout, dev)
            _attempt(failures, label, comm.broadcast, t.view, src)
            problem = _exact(label, t.view, want)
            if problem:
                failures.append(problem)
            if not t.neighbours_intact():
                failures.append(f"{label}: wrote outside the strided view")
    return failures


def check_all_gather_into_tensor(comm: Communicator, *, seed: int) -> list[str]:
    failures: list[str] = []
    dev, world, me = _device(comm), comm.world_size, comm.rank
    for index, dname, dtype, n, layout in _cases():
        label = _label("all_gather_into_tensor", dname, n, layout)
        case_seed = seed * 1000 + index
        inputs = [_input(case_seed, r, n, dtype) for r in range(world)]
        src = _Strided(inputs[me], layout, dev)
        out = _empty(world * n, dtype, layout, dev)
        _attempt(failures, label, comm.all_gather_into_tensor, out.view, src.view)
        for problem in (
            _exact(label, out.view, torch.cat(inputs)),
            _exact(f"{label} (input modified)", src.view, inputs[me]),
        ):
            if problem:
                failures.append(problem)
        if not out.neighbours_intact():
            failures.append(f"{label}: wrote outside the strided output")
    # the 2-D form: (n, 3) per rank gathered to (world * n, 3)
    inputs = [_input(seed * 1000 + 999, r, 6, torch.float32).view(2, 3) for r in range(world)]
    out2 = torch.zeros(world * 2, 3, device=dev)
    _attempt(failures, "all_gather_into_tensor 2-D", comm.all_gather_into_tensor, out2, inputs[me].to(dev))
    problem = _exact("all_gather_into_tensor 2-D", out2, torch.cat(inputs))
    if problem:
        failures.append(problem)
    return failures


def check_reduce_scatter_tensor(comm: Communicator, *, seed: int,
                                ops: Sequence[str] = ("sum", "mean", "max", "min")) -> list[str]:
    failures: list[str] = []
    dev, world, me = _device(comm), comm.world_size, comm.rank
    for op_name in ops:
        op = ReduceOp(op_name)
        for (index, dname, dtype, n, layout), reuse in itertools.product(_cases(), (False, True)):
            if op is ReduceOp.MEAN and not dtype.is_floating_point:
                continue
            # reuse_input: the backend may reduce in the input (its values are unspecified after)
            label = _label(f"reduce_scatter_tensor[{op_name}{', reuse_input' if reuse else ''}]", dname, n,
                           layout)
            case_seed = seed * 1000 + index
            inputs = [_input(case_seed, r, world * n, dtype) for r in range(world)]
            check = _reference(op, [t[me * n:(me + 1) * n] for t in inputs], dtype)
            src = _Strided(inputs[me], layout, dev)
            out = _empty(n, dtype, layout, dev)
            _attempt(failures, label, comm.reduce_scatter_tensor, out.view, src.view, op, reuse_input=reuse)
            unchanged = None if reuse else _exact(f"{label} (input modified)", src.view, inputs[me])
            for problem in (check(label, out.view), unchanged):
                if problem:
                    failures.append(problem)
            if not out.neighbours_intact():
                failures.append(f"{label}: wrote outside the strided output")
    return failures


def check_all_gather_list(comm: Communicator, *, seed: int) -> list[str]:
    failures: list[str] = []
    dev, world, me = _device(comm), comm.world_size, comm.rank
    for index, dname, dtype, n, layout in _cases():
        label = _label("all_gather(list)", dname, n, layout)
        inputs = [_input(seed * 1000 + index, r, n, dtype) for r in range(world)]
        outs = [_empty(n, dtype, layout, dev) for _ in range(world)]
        src = _Strided(inputs[me], layout, dev)
        _attempt(failures, label, comm.all_gather, [o.view for o in outs], src.view)
        for r in range(world):
            problem = _exact(f"{label} outputs[{r}]", outs[r].view, inputs[r])
            if problem:
                failures.append(problem)
    return failures


def check_reduce_scatter_list(
    comm: Communicator, *, seed: int, ops: Sequence[str] = ("sum", "max")
) -> list[str]:
    failures: list[str] = []
    dev, world, me = _device(comm), comm.world_size, comm.rank
    for op_name in ops:
        op = ReduceOp(op_name)
        for index, dname, dtype, n, layout in _cases():
            label = _label(f"reduce_scatter(list)[{op_name}]", dname, n, layout)
            case_seed = seed * 1000 + index
            # rank r's inputs[q] is part q of its full input
            full = [_input(case_seed, r, world * n, dtype) for r in range(world)]
            check = _reference(op, [t[me * n:(me + 1) * n] for t in full], dtype)
            parts = [_Strided(full[me][q * n:(q + 1) * n], layout, dev) for q in range(world)]
            out = _empty(n, dtype, layout, dev)
            _attempt(failures, label, comm.reduce_scatter, out.view, [p.view for p in parts], op)
            problem = check(label, out.view)
            if problem:
                failures.append(problem)
    return failures


def check_async_collectives(comm: Communicator, *, seed: int, poll_s: float = 10.0) -> list[str]:
    """Several async collectives in flight at once; ``is_completed()`` turns True by itself
    (polled, bounded), then each is waited in order; results all correct."""
    failures: list[str] = []
    dev, world, me = _device(comm), comm.world_size, comm.rank
    n = 4097
    inputs = [[_input(seed * 1000 + k, r, n, torch.float64) for r in range(world)] for k in range(5)]
    tensors = [inputs[k][me].to(dev).clone() for k in range(4)]
    works: list[Work] = [comm.all_reduce(tensors[k], async_op=True) for k in range(3)]
    works.append(comm.broadcast(tensors[3], world - 1, async_op=True))
    scattered = torch.zeros(n, dtype=torch.float64, device=dev)
    full = [torch.cat([inputs[4][r]] * world) for r in range(world)]
    works.append(comm.reduce_scatter_tensor(scattered, full[me].to(dev), async_op=True))
    deadline = time.monotonic() + poll_s
    while not all(w.is_completed() for w in works) and time.monotonic() < deadline:
        time.sleep(0.005)
    pending = [i for i, w in enumerate(works) if not w.is_completed()]
    if pending:
        failures.append(f"async: works {pending} not is_completed() after {poll_s}s of polling")
    for work in works:
        work.wait()
        if not work.is_completed():
            failures.append("async: is_completed() is False after wait()")
    problem = _reference(ReduceOp.SUM, inputs[4], torch.float64)("async reduce_scatter_tensor", scattered)
    if problem:
        failures.append(problem)
    for k in range(3):
        problem = _reference(ReduceOp.SUM, inputs[k], torch.float64)(f"async all_reduce #{k}", tensors[k])
        if problem:
            failures.append(problem)
    problem = _exact("async broadcast", tensors[3], inputs[3][world - 1])
    if problem:
        failures.append(problem)
    return failures


def check_barrier(comm: Communicator, *, delay_s: float = 0.3) -> list[str]:
    """The last rank enters late; nobody may leave the barrier before it entered."""
    comm.barrier()
    late = comm.world_size - 1
    start = time.monotonic()
    if comm.rank == late:
        time.sleep(delay_s)
    comm.barrier()
    took = time.monotonic() - start
    if comm.world_size > 1 and comm.rank != late and took < delay_s * 0.8:
        return [f"barrier returned after {took:.3f}s, before rank {late} entered ({delay_s}s late)"]
    return []


def check_argument_errors(comm: Communicator) -> list[str]:
    """Bad arguments raise ValueError on the calling rank before anything is sent."""
    failures: list[str] = []
    dev, world = _device(comm), comm.world_size
    attempts: dict[str, Callable[[], object]] = {
        "all_reduce MEAN int64": lambda: comm.all_reduce(
            torch.ones(3, dtype=torch.int64, device=dev), ReduceOp.MEAN),
        "all_gather_into_tensor wrong size": lambda: comm.all_gather_into_tensor(
            torch.zeros(world * 3 + 1, device=dev), torch.zeros(3, device=dev)),
        "reduce_scatter_tensor wrong size": lambda: comm.reduce_scatter_tensor(
            torch.zeros(2, device=dev), torch.zeros(world * 2 + 1, device=dev)),
        "broadcast bad src": lambda: comm.broadcast(torch.zeros(2, device=dev), world),
        "send to self": lambda: comm.send(torch.zeros(2, device=dev), comm.rank),
        "recv from outside": lambda: comm.recv(torch.zeros(2, device=dev), world),
    }
    for what, attempt in attempts.items():
        try:
            attempt()
            failures.append(f"{what}: did not raise ValueError")
        except ValueError:
            pass
        except Exception as exc:
            failures.append(f"{what}: raised {type(exc).__name__} instead of ValueError: {exc}")
    comm.barrier()
    return failures


def check_bytes_sent(comm: Communicator, *, numels: Sequence[int] = (96, 49152)) -> list[str]:
    """Each call counts the bytes sent that [Note: what "bytes sent" counts] (comm/traffic.py) says.

    The expectation is each algorithm's, as documented: for zmq, recursive doubling (up to
    ``DOUBLING_MAX_BYTES``) sends the tensor log2(p) times (p the largest power of two <= n), a rank
    folding in a partner once more and the folded rank once; the ring 2(n-1)/n of it, a small
    broadcast goes from the root to every rank and a large one down a chain (every rank but the
    last sends it once), all-gather and reduce-scatter walk n-1 ring steps of one shard; for gloo
    and nccl a call counts what this rank contributes. ``numels`` are float32 sizes divisible by
    12 (equal shards for 2, 3 and 4 ranks), one below and one above ``SMALL_BYTES`` and
    ``DOUBLING_MAX_BYTES``.
    """
    from comm.traffic import SENT
    from comm.zmq.collectives import DOUBLING_MAX_BYTES, SMALL_BYTES

    failures: list[str] = []
    n, me, zmq = comm.world_size, comm.rank, comm.backend == "zmq"
    src = n - 1  # the broadcast's root: its chain ends at rank n - 2

    def expect(label: str, want: int, call: Callable[..., object], *args: Any) -> None:
        before = SENT.totals().get(comm.backend, 0)
        call(*args)
        got = SENT.totals().get(comm.backend, 0) - before
        if got != want:
            failures.append(f"{label}: counted {got} bytes sent on rank {me}, expected {want}")

    for numel in numels:
        x = torch.ones(numel, device=_device(comm))
        size, shard = numel * 4, numel // n * 4
        large = size > SMALL_BYTES
        p = 1 << (n.bit_length() - 1)
        folded = me < 2 * (n - p)
        doubling = size if folded and me % 2 == 0 else (p.bit_length() - 1 + folded) * size
        expect(f"all_reduce of {size} bytes",
               (2 * (n - 1) * size // n if size > DOUBLING_MAX_BYTES else doubling) if zmq else size,
               comm.all_reduce, x)
        if zmq:
            root = size if large and me != (src - 1) % n else (n - 1) * size if not large and me == src else 0
        else:
            root = size if me == src else 0
        expect(f"broadcast of {size} bytes from rank {src}", root, comm.broadcast, x, src)
        out = torch.empty(numel, device=x.device)
        expect(f"all_gather_into_tensor of {shard}-byte shards", (n - 1) * shard if zmq else shard,
               comm.all_gather_into_tensor, out, x[:numel // n])
        expect(f"reduce_scatter_tensor of {size} bytes", (n - 1) * shard if zmq else size,
               comm.reduce_scatter_tensor, out[:numel // n], x)
        if me == 0:
            expect(f"send of {size} bytes", size, comm.send, x, 1)
        elif me == 1:
            expect(f"recv of {size} bytes", 0, comm.recv, out, 0)
    comm.barrier()
    return failures


# -- point to point ---------------------------------------------------------------------------


def check_send_recv(comm: Communicator, *, seed: int) -> list[str]:
    """Blocking send/recv between every pair, in a global pair order (deadlock-free)."""
    failures: list[str] = []
    dev, world, me = _device(comm), comm.world_size, comm.rank
    for index, dname, dtype, n, layout in _cases():
        case_seed = seed * 1000 + index
        for a, b in itertools.combinations(range(world), 2):
            if me not in (a, b):
                continue
            other = b if me == a else a
            label = _label(f"send/recv {a}<->{b}", dname, n, layout)
            mine = _Strided(_input(case_seed, me, n, dtype), layout, dev)
            got = _empty(n, dtype, layout, dev)
            _attempt(failures, label, _exchange, comm, mine.view, got.view, other, index % 7, first=me == a)
            unchanged = _exact(f"{label} (send buffer modified)", mine.view, _input(case_seed, me, n, dtype))
            for problem in (_exact(label, got.view, _input(case_seed, other, n, dtype)), unchanged):
                if problem:
                    failures.append(problem)
            if not got.neighbours_intact():
                failures.append(f"{label}: wrote outside the strided view")
    return failures


def check_isend_irecv(comm: Communicator, *, seed: int) -> list[str]:
    """Every rank posts irecvs from all others, then isends to all others, then waits."""
    failures: list[str] = []
    dev, world, me = _device(comm), comm.world_size, comm.rank
    for index, dname, dtype, n, layout in _cases():
        case_seed = seed * 1000 + index
        label = _label("isend/irecv", dname, n, layout)
        others = [r for r in range(world) if r != me]
        got = {r: _empty(n, dtype, layout, dev) for r in others}
        mine = _Strided(_input(case_seed, me, n, dtype), layout, dev)
        _attempt(failures, label, _all_to_all, comm, mine.view, {r: g.view for r, g in got.items()},
                 1 + index % 5)
        for r in others:
            problem = _exact(f"{label} from {r}", got[r].view, _input(case_seed, r, n, dtype))
            if problem:
                failures.append(problem)
    return failures


def _exchange(comm: Communicator, mine: torch.Tensor, got: torch.Tensor, other: int, tag: int, *,
              first: bool) -> None:
    if first:
        comm.send(mine, other, tag=tag)
        comm.recv(got, other, tag=tag)
    else:
        comm.recv(got, other, tag=tag)
        comm.send(mine, other, tag=tag)


def _all_to_all(comm: Communicator, mine: torch.Tensor, got: dict[int, torch.Tensor], tag: int) -> None:
    recvs = [comm.irecv(buf, r, tag=tag) for r, buf in got.items()]
    sends = [comm.isend(mine, r, tag=tag) for r in got]
    for work in recvs + sends:
        work.wait()


def check_p2p_polling(comm: Communicator, *, poll_s: float = 10.0) -> list[str]:
    """isend/irecv handles turn ``is_completed()`` by themselves (nobody waits yet)."""
    failures: list[str] = []
    dev, world, me = _device(comm), comm.world_size, comm.rank
    right, left = (me + 1) % world, (me - 1) % world
    payload = torch.full((1000,), float(me), device=dev)
    got = torch.zeros(1000, device=dev)
    works = [comm.irecv(got, left, tag=3), comm.isend(payload, right, tag=3)]
    deadline = time.monotonic() + poll_s
    while not all(w.is_completed() for w in works) and time.monotonic() < deadline:
        time.sleep(0.005)
    if not all(w.is_completed() for w in works):
        failures.append(f"p2p: is_completed() still False after {poll_s}s of polling")
    for work in works:
        work.wait()
    problem = _exact(f"p2p polled recv from {left}", got, torch.full((1000,), float(left)))
    if problem:
        failures.append(problem)
    comm.barrier()
    return failures


def check_p2p_ordering(comm: Communicator, *, count: int = 8) -> list[str]:
    """Rank r sends to r+1 interleaved messages on tags 1 and 2; each tag's arrive in order."""
    failures: list[str] = []
    dev, world, me = _device(comm), comm.world_size, comm.rank
    right, left = (me + 1) % world, (me - 1) % world
    sends = []
    for i in range(count):
        for tag in (1, 2):
            payload = torch.full((33,), float(me * 10000 + tag * 1000 + i), device=dev)
            sends.append((comm.isend(payload, right, tag=tag), payload))
    # receive tag 2 first: tag-1 messages must wait for their own receives, not fill these
    slots = {tag: [torch.zeros(33, device=dev) for _ in range(count)] for tag in (2, 1)}
    recvs = [comm.irecv(buf, left, tag=tag) for tag in (2, 1) for buf in slots[tag]]
    for work in recvs:
        work.wait()
    for work, _payload in sends:
        work.wait()
    for tag in (1, 2):
        got = [int(buf[0].item()) for buf in slots[tag]]
        want = [left * 10000 + tag * 1000 + i for i in range(count)]
        if got != want:
            failures.append(f"p2p order, tag {tag} from rank {left}: got {got}, want {want}")
    comm.barrier()
    return failures


# -- groups, timeouts, size ------------------------------------------------------------------


def check_subgroups(comm: Communicator, *, seed: int, rounds: int = 20) -> list[str]:
    """World 4: groups {0,1} and {2,3} all_reduce at the same time; {3,1} is renumbered."""
    failures: list[str] = []
    dev, me = _device(comm), comm.rank
    low, high = comm.new_group([0, 1]), comm.new_group([2, 3])
    odd = comm.new_group([3, 1])  # group rank 0 is global rank 3
    mine = low if me < 2 else high
    members = [0, 1] if me < 2 else [2, 3]
    if mine is None or (low is None) == (high is None):
        return [f"rank {me}: new_group returned {low!r} for [0, 1] and {high!r} for [2, 3]"]
    if mine.rank != members.index(me) or mine.world_size != 2:
        failures.append(f"group {members}: rank {mine.rank}/{mine.world_size}, want {members.index(me)}/2")
    for i in range(rounds):
        inputs = [_input(seed * 1000 + i, r, 1000, torch.float64) for r in members]
        t = _input(seed * 1000 + i, me, 1000, torch.float64).to(dev)
        mine.all_reduce(t)
        problem = _reference(ReduceOp.SUM, inputs, torch.float64)(f"group {members} round {i}", t)
        if problem:
            failures.append(problem)
    if (odd is None) != (me in (0, 2)):
        failures.append(f"rank {me}: new_group([3, 1]) returned {odd!r}")
    if odd is not None:
        if odd.rank != [3, 1].index(me):
            failures.append(f"group [3, 1]: rank {me} has group rank {odd.rank}, want {[3, 1].index(me)}")
        t = _input(seed, me, 17, torch.float32).to(dev)
        odd.broadcast(t, 0)  # from global rank 3
        problem = _exact("group [3, 1] broadcast from its rank 0", t, _input(seed, 3, 17, torch.float32))
        if problem:
            failures.append(problem)
    t = torch.ones(5, device=dev)
    comm.all_reduce(t)
    problem = _exact("world all_reduce after sub-groups", t, torch.full((5,), float(comm.world_size)))
    if problem:
        failures.append(problem)
    for group in (low, high, odd):
        if group is not None:
            group.close()
    comm.barrier()
    return failures


def check_recv_timeout(comm: Communicator, *, timeout_s: float = 0.5) -> list[str]:
    """On a fresh sub-group (so the main communicator stays healthy): a recv nobody sends to."""
    failures: list[str] = []
    group = comm.new_group(list(range(comm.world_size)))
    assert group is not None
    if comm.rank == 1:
        buf = torch.zeros(4, device=_device(comm))
        start = time.monotonic()
        try:
            group.recv(buf, 0, tag=77, timeout=timedelta(seconds=timeout_s))
            failures.append("recv from a silent peer returned instead of raising CommTimeoutError")
        except CommTimeoutError as exc:
            took = time.monotonic() - start
            if not timeout_s * 0.9 <= took <= timeout_s + 2.0:
                failures.append(f"CommTimeoutError after {took:.2f}s for a {timeout_s}s timeout")
            if exc.op != "recv" or exc.peer != 0:
                failures.append(f"CommTimeoutError names op={exc.op!r} peer={exc.peer!r}, want 'recv' and 0")
            if "0" not in str(exc):
                failures.append(f"CommTimeoutError message does not name the peer: {exc}")
        except Exception as exc:
            failures.append(f"recv timeout raised {type(exc).__name__}: {exc}")
    comm.barrier()  # rank 0 keeps the group open until rank 1 gave up
    group.close()
    return failures


def check_large(comm: Communicator, *, seed: int, mib: int = 64) -> list[str]:
    """A ``mib`` MiB float32 all_reduce and broadcast; integer-valued floats make SUM exact."""
    failures: list[str] = []
    dev, world, me = _device(comm), comm.world_size, comm.rank
    n = (mib << 20) // 4

    def make(r: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed * 1000 + r)
        return torch.randint(0, 1024, (n,), generator=gen, dtype=torch.int32).float()

    t = make(me).to(dev)
    comm.all_reduce(t)
    want = make(0)
    for r in range(1, world):
        want += make(r)
    problem = _exact(f"all_reduce {mib} MiB", t, want)
    if problem:
        failures.append(problem)
    del want
    t = make(me).to(dev)
    comm.broadcast(t, world - 1)
    problem = _exact(f"broadcast {mib} MiB from {world - 1}", t, make(world - 1))
    if problem:
        failures.append(problem)
    return failures


# -- fault injection ----------------------------------------------------------------------------


def warm_up(comm: Communicator) -> int:
    t = torch.ones(16, device=_device(comm))
    comm.all_reduce(t)
    comm.barrier()
    return comm.rank


def loop_all_reduce(comm: Communicator, *, numel: int, seconds: float, timeout_s: float) -> dict[str, Any]:
    """All-reduce a large tensor until an error (or ``seconds``); report the error and its time."""
    t = torch.ones(numel, device=_device(comm))
    deadline = time.monotonic() + seconds
    iterations = 0
    outcome: dict[str, Any] = {"error": None, "iterations": 0}
    while time.monotonic() < deadline:
        try:
            comm.all_reduce(t, timeout=timedelta(seconds=timeout_s))
            t.fill_(1.0)
            iterations += 1
        except Exception as exc:
            outcome = _describe(exc)
            break
    outcome["iterations"] = iterations
    return outcome


def loop_recv_from(comm: Communicator, *, hub: int, numel: int, seconds: float,
                   timeout_s: float) -> dict[str, Any]:
    """Rank ``hub`` sends to every other rank in turn, the others receive from it, until an
    error (or ``seconds``); the receivers report the error and its time."""
    t = torch.ones(numel, device=_device(comm))
    deadline = time.monotonic() + seconds
    iterations = 0
    outcome: dict[str, Any] = {"error": None}
    limit = timedelta(seconds=timeout_s)
    while time.monotonic() < deadline:
        try:
            if comm.rank == hub:
                for r in range(comm.world_size):
                    if r != hub:
                        comm.send(t, r, tag=9, timeout=limit)
            else:
                comm.recv(t, hub, tag=9, timeout=limit)
            iterations += 1
        except Exception as exc:
            outcome = _describe(exc)
            break
    outcome["iterations"] = iterations
    return outcome


def _describe(exc: BaseException) -> dict[str, Any]:
    return {
        "error": type(exc).__name__,
        "comm_error": isinstance(exc, CommError),
        "peer": getattr(exc, "peer", None),
        "op": getattr(exc, "op", None),
        "message": str(exc),
        "at": time.time(),
    }


def ping(comm: Communicator) -> int:
    """Answer without communicating: the process is alive and serving commands."""
    return comm.rank
