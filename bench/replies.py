"""What reading a step reply costs the coordinator: the validating path against the C decoder, warm and cold.

The coordinator reads one ``StepReply`` per stage per step (``coordinator/runtime/loop.py``). This times,
in one thread with nothing else in the process, the two ways a reply's first frame becomes a message:

* ``models``: msgpack, then pydantic's validation of the envelope (``ReplyEnvelope``) and of the body
  (``StepReply``), as every reply was read before the hand check (``comm.rpc.framing.read_reply`` and
  ``open_reply``);
* ``msgspec``: ``services.protocol.hot.step_reply_frame``, the envelope and the body decoded and checked
  in one msgspec call, then made the models without validation: the loop's path now ([Note: why the step
  reply is decoded in C] in ``services/protocol/hot.py``);

and what building a step's request costs (``comm.rpc.framing.request_frames`` of a ``RunStep`` naming
its program, with the previous step's commit, and the runtime's path: its body packed once, its envelope
from a cached head, ``comm/rpc/hot.py``). Three replies: a hollow data-parallel worker's (2 actions),
a 1F1B stage of 2 stages x 8 microbatches (32 actions, the traffic counters, a phase), and one with
several phases and refusal counts.

Warm: the median of ``--repeats`` runs of ``--number`` calls each, µs per call of this thread's CPU
(``time.thread_time``): a reply read right after the last, as the coordinator reads a burst. Cold: before
each call the thread writes 64 MiB (evicting the caches, as a training step's compute does between two
replies), then times the one call (wall clock, ``perf_counter_ns``); the median of ``--cold`` calls, the
two paths alternating.

    python bench/replies.py [--number 20000] [--repeats 7] [--cold 300]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

if not __package__:  # run as `python bench/x.py`: keep bench/comm.py from shadowing the comm package
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from comm.rpc.framing import open_reply, read_reply, reply_frames, request_frames
from comm.rpc.hot import PackedBody, RequestHeads
from comm.traffic import TrafficCounts
from services.protocol import CommitStep, OptimizerSpec, PhaseTiming, StepReply, pack_times
from services.protocol.hot import step_reply_frame


def _reply(actions: int, *, losses: int, phases: list[PhaseTiming], traffic: TrafficCounts | None
           ) -> StepReply:
    t0 = 1_795_880_974.828326
    return StepReply(step=12, stage=1, losses=[0.98765 + i for i in range(losses)],
                     times=pack_times([t0 + 0.001 * k for k in range(actions)],
                                      [t0 + 0.001 * k + 0.0005 for k in range(actions)]),
                     phases=phases, traffic=traffic, grad_sq_norm=1.25, held_bytes=1 << 20)


REPLIES: dict[str, StepReply] = {
    "hollow dp (2 actions)": _reply(2, losses=1, phases=[], traffic=TrafficCounts()),
    "1F1B 2x8 stage (32 actions)": _reply(32, losses=8, phases=[PhaseTiming(name="optimizer", start=1.0,
                                                                            end=1.5)],
                                          traffic=TrafficCounts(bytes_sent={"zmq": 123_456_789})),
    "dp stage, phases, refusals": _reply(2, losses=1, phases=[PhaseTiming(name=n, start=1.0, end=2.0) for n in
                                                              ("optimizer", "all_reduce", "tied_sync")],
                                         traffic=TrafficCounts(bytes_sent={"zmq": 1 << 30, "gloo": 1 << 20},
                                                               refused_frames={"bad header": 3},
                                                               refused_connections={"curve": 1})),
}


def _models(frame: bytes) -> StepReply:
    envelope = read_reply(frame, "bench")
    assert envelope is not None
    body, _ = open_reply(envelope, [], StepReply, "compute", "run_step")
    return body


def _fast(frame: bytes) -> StepReply:
    read = step_reply_frame(frame)
    assert read is not None
    return read[1]


def per_call_us(fn: Callable[[], Any], number: int, repeats: int) -> float:
    runs = []
    for _ in range(repeats):
        start = time.thread_time()
        for _ in range(number):
            fn()
        runs.append((time.thread_time() - start) / number * 1e6)
    return statistics.median(runs)


def cold_us(paths: dict[str, Callable[[], Any]], calls: int) -> dict[str, float]:
    """The median µs of one call of each path right after the caches were evicted (see the docstring)."""
    import torch

    torch.set_num_threads(1)
    evict = torch.zeros(16 << 20)  # 64 MiB
    times: dict[str, list[float]] = {name: [] for name in paths}
    order = list(paths.items())
    for i in range(calls):
        for name, fn in order if i % 2 else reversed(order):
            evict.add_(1.0)
            start = time.perf_counter_ns()
            fn()
            times[name].append((time.perf_counter_ns() - start) / 1e3)
    return {name: statistics.median(v) for name, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--number", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--cold", type=int, default=300)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f} at the start")
    print("| reply | bytes | warm: models µs | msgspec µs | cold: models µs | msgspec µs |")
    print("|---|---|---|---|---|---|")
    for name, reply in REPLIES.items():
        frame = bytes(reply_frames(7, reply)[0])
        assert _models(frame) == _fast(frame) == reply
        models = per_call_us(lambda f=frame: _models(f), args.number, args.repeats)
        fast = per_call_us(lambda f=frame: _fast(f), args.number, args.repeats)
        cold = cold_us({"models": lambda f=frame: _models(f), "fast": lambda f=frame: _fast(f)}, args.cold)
        print(f"| {name} | {len(frame)} | {models:.1f} | {fast:.1f} | {cold['models']:.1f} "
              f"| {cold['fast']:.1f} |")
    optimizer = OptimizerSpec(name="SGD", kwargs={"lr": 0.01})
    commit = CommitStep(step=11, optimizer=optimizer, timeout_ms=300_000, train_step=11).model_dump()
    request = {"step": 12, "program": "train", "timeout_ms": 300_000, "loss_scale": 1.0, "commit": commit,
               "microbatches": [list(range(8 * m, 8 * m + 8)) for m in range(8)]}
    build = per_call_us(lambda: request_frames(12, "run/compute-r0-s0", "run_step", request), args.number,
                        args.repeats)
    heads = RequestHeads()
    packed = per_call_us(lambda: heads.frame(12, "run/compute-r0-s0", "run_step", PackedBody(request)),
                         args.number, args.repeats)
    print(f"\nbuilding a step's request (8 microbatches of 8 samples, a commit): {build:.1f} µs; "
          f"packed (PackedBody, RequestHeads: the runtime's path) {packed:.1f} µs")
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
