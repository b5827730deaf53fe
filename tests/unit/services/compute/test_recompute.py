"""Recompute per node in one process: what a recomputing stage holds, and what it computes.

The memory a stage holds after its forward is measured, not estimated: torch's profiler records
every allocation and free of the CPU allocator, and their net sum over the forward (and loss) is
what stays allocated for the backward. The gradients are compared with the plain stage module's
(same parameters, same inputs) under float64, under bf16 autocast and with keyed dropout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from services.compute.randomness import ModelRandomness, replaying
from services.compute.recompute import attribute_replay, recomputed_forward
from services.compute.stage import Stage, build_stage
from services.compute.weight_grads import WeightGradStore
from services.factories import FactoryAllowList
from services.protocol import Assignment, ComputeOptions

HERE = "tests.unit.services.compute.test_recompute"
WIDTH, HIDDEN, DEPTH, ROWS = 32, 256, 4, 64


def wide_cells(p: float = 0.0, dtype: str = "float64") -> list[nn.Module]:
    """Four cells each widening ``WIDTH`` to ``HIDDEN`` and back (with dropout when ``p``), then a head."""
    cells: list[nn.Module] = [nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.Tanh(), nn.Dropout(p),
                                            nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, WIDTH))
                              for _ in range(DEPTH)]
    cells.append(nn.Linear(WIDTH, 1))
    return [c.to(getattr(torch, dtype)) for c in cells]


def samples(dtype: str = "float64") -> tuple[torch.Tensor, torch.Tensor]:
    kind = getattr(torch, dtype)
    return torch.randn(ROWS, WIDTH, dtype=kind), torch.randn(ROWS, 1, dtype=kind)


def mse() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    return nn.MSELoss()


def stage(recompute: bool, **kwargs: Any) -> Stage:
    options = ComputeOptions(stage=0, num_stages=1, data=f"{HERE}:samples", loss=f"{HERE}:mse",
                             recompute=recompute, factory_kwargs=kwargs,
                             data_kwargs={"dtype": kwargs.get("dtype", "float64")})
    factories = FactoryAllowList.of([f"{HERE}:{n}" for n in ("wide_cells", "samples", "mse")], "a test")
    assignment = Assignment(service="c", kind="compute", factory=f"{HERE}:wide_cells", nodes=[0, DEPTH + 1],
                            seed=3, options=options.model_dump())
    return build_stage(assignment, options, factories)


def forward(st: Stage, x: torch.Tensor) -> torch.Tensor:
    return recomputed_forward(st.pieces, x, [replaying]) if st.pieces is not None else st.module(x)


def held_bytes(st: Stage) -> tuple[int, dict[str, torch.Tensor]]:
    """The bytes allocated by the forward and loss and still allocated after them; the gradients."""
    assert st.samples is not None and st.loss_fn is not None
    x, y = st.samples.load(list(range(ROWS)))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = st.loss_fn(forward(st, x), y)
    held = sum(e.self_cpu_memory_usage for e in prof.events())
    loss.backward()
    return held, {n: p.grad.clone() for n, p in st.parameters() if p.grad is not None}


def test_a_recomputing_stage_holds_its_cuts_only_and_computes_the_same_gradients() -> None:
    plain, recomputing = stage(False), stage(True)
    assert plain.pieces is None and recomputing.pieces is not None and len(recomputing.pieces) == DEPTH + 1
    held_plain, grads_plain = held_bytes(plain)
    held_rc, grads_rc = held_bytes(recomputing)
    # plain: per cell at least its two tanh outputs (saved by tanh's backward and by the next linear's:
    # 2 * ROWS * HIDDEN float64 = 256 KiB); recompute: one WIDTH-wide value per cut (16 KiB each) and the
    # loss's (measured: 1089 KiB and 90 KiB)
    per_cell = 2 * ROWS * HIDDEN * 8
    assert held_plain > DEPTH * per_cell * 0.9, held_plain
    assert held_rc < DEPTH * ROWS * WIDTH * 8 * 2 + 64 * 1024, held_rc
    assert held_rc * 8 < held_plain, (held_rc, held_plain)
    assert grads_plain.keys() == grads_rc.keys()
    assert max(float((grads_plain[k] - grads_rc[k]).abs().max()) for k in grads_plain) < 1e-12


def test_recomputed_dropout_draws_the_forwards_masks() -> None:
    """Keyed dropout: the recomputation replays the forward's draws (without the replay it would not)."""
    def grads(st: Stage, replays: bool) -> dict[str, torch.Tensor]:
        assert st.samples is not None and st.loss_fn is not None
        x, y = st.samples.load(list(range(ROWS)))
        with ModelRandomness(st.module, 7).forward(2, list(range(ROWS))):
            out = (recomputed_forward(st.pieces, x, [replaying] if replays else []) if st.pieces is not None
                   else st.module(x))
            loss = st.loss_fn(out, y)
        loss.backward()
        return {n: p.grad.clone() for n, p in st.parameters()}

    plain = grads(stage(False, p=0.3), True)
    replayed = grads(stage(True, p=0.3), True)
    unreplayed = grads(stage(True, p=0.3), False)
    assert max(float((plain[k] - replayed[k]).abs().max()) for k in plain) < 1e-12
    assert max(float((plain[k] - unreplayed[k]).abs().max()) for k in plain) > 1e-3


def test_recompute_under_bf16_autocast_computes_what_the_autocast_forward_does() -> None:
    """The recomputation runs under the forward's autocast: the same bf16 matmuls, the same gradients."""
    def grads(st: Stage) -> dict[str, torch.Tensor]:
        assert st.samples is not None and st.loss_fn is not None
        x, y = st.samples.load(list(range(ROWS)))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = st.loss_fn(forward(st, x), y)
        loss.backward()
        return {n: p.grad.clone() for n, p in st.parameters()}

    plain, recomputing = grads(stage(False, dtype="float32")), grads(stage(True, dtype="float32"))
    assert max(float((plain[k] - recomputing[k]).abs().max()) for k in plain) == 0.0
    with torch.no_grad():
        st = stage(False, dtype="float32")
        x, _ = samples("float32")
        full = st.module(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = st.module(x)
    assert float((full - low.float()).abs().max()) > 1e-4  # autocast did change the forward


@pytest.mark.parametrize("flush", ["gpipe", "per microbatch"])
def test_deferred_weight_gradients_of_recomputed_layers_are_exact(flush: str) -> None:
    """I then W over recomputed nodes: each layer queues under its forward's microbatch, whatever the
    store's microbatch is by the backward (the replay puts the forward's back for the recomputation)."""
    def run(recompute: bool) -> dict[str, torch.Tensor]:
        st = stage(recompute)
        assert st.samples is not None and st.loss_fn is not None
        store = WeightGradStore(st.module)
        losses = []
        with store.deferring():
            for m in range(4):
                store.microbatch = m
                x, y = st.samples.load(list(range(16 * m, 16 * m + 16)))
                replays = [attribute_replay(store, "microbatch")]
                out = recomputed_forward(st.pieces, x, replays) if st.pieces is not None else st.module(x)
                losses.append(st.loss_fn(out, y))
            store.microbatch = None  # moved on, as the executor's is by its backwards
            for m in reversed(range(4)):
                losses[m].backward()
                if flush == "per microbatch":
                    store.flush([m], final=m == 0)
            if flush == "gpipe":
                assert store.pending() == [0, 1, 2, 3]
                store.flush(None, final=True)
        assert store.layers and store.pending() == []
        return {n: p.grad.clone() for n, p in st.parameters()}

    plain, recomputing = run(False), run(True)
    assert max(float((plain[k] - recomputing[k]).abs().max()) for k in plain) < 1e-12
