"""fp16's loss scale: ``torch.amp.GradScaler``'s state machine, its checkpoint, an overflow as a skipped step.

Both scalers run with a growth interval of 5 (:data:`INTERVAL`, patched into cellmesh's) so a
sequence shows several growths in a few dozen steps; the defaults are compared on their own.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from coordinator.runtime import scaler as scaler_module
from coordinator.runtime.checkpoints import TrainerState
from coordinator.runtime.nonfinite import NonFiniteStep, overflowed
from coordinator.runtime.records import _Service
from coordinator.runtime.scaler import LossScaler, ScalerState
from services.protocol import StepReply

INTERVAL = 5


@pytest.fixture(autouse=True)
def _short_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scaler_module, "GROWTH_INTERVAL", INTERVAL)


class TorchScaler:
    """``torch.amp.GradScaler("cpu")`` driven by a found-Inf flag: one parameter's gradient is Inf or 1."""

    def __init__(self, init_scale: float = 2.0 ** 16) -> None:
        self.param = torch.nn.Parameter(torch.zeros(1))
        self.optimizer = torch.optim.SGD([self.param], lr=0.0)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=INTERVAL)

    def step(self, found_inf: bool) -> None:
        self.scaler.scale(torch.ones(()))  # the scale exists from the first scale()
        self.param.grad = torch.full((1,), float("inf") if found_inf else 1.0)
        self.scaler.step(self.optimizer)
        self.scaler.update()

    @property
    def state(self) -> tuple[float, int]:
        tracker = self.scaler._get_growth_tracker()  # its growth count: no public reader
        return self.scaler.get_scale(), int(tracker.item() if isinstance(tracker, torch.Tensor) else tracker)


def run_both(flags: list[bool], state: ScalerState | None = None) -> list[tuple[tuple[float, int], ...]]:
    ours, theirs = LossScaler(state), TorchScaler(state.scale if state is not None else 2.0 ** 16)
    if state is not None:
        for _ in range(state.growth_tracker):  # bring torch's count to the state's
            theirs.step(False)
    trace = []
    for found_inf in flags:
        ours.update(found_inf)
        theirs.step(found_inf)
        trace.append(((ours.scale, ours.growth_tracker), theirs.state))
    return trace


def test_grad_scalers_defaults() -> None:
    torchs = torch.amp.GradScaler("cpu")
    ours = (scaler_module.INIT_SCALE, scaler_module.GROWTH_FACTOR, scaler_module.BACKOFF_FACTOR)
    assert ours == (torchs.get_scale(), torchs.get_growth_factor(), torchs.get_backoff_factor())
    assert INTERVAL != 2000 and torchs.get_growth_interval() == 2000
    scaler = LossScaler()
    assert (scaler.scale, scaler.growth_tracker, scaler.inverse) == (65536.0, 0, 2.0 ** -16)


def test_a_random_sequence_of_overflows_moves_the_scale_as_grad_scaler_moves_it() -> None:
    rng = random.Random(0)
    flags = [rng.random() < 0.3 for _ in range(60)] + [True] + [False] * 10
    trace = run_both(flags)
    first = next((i for i, (ours, theirs) in enumerate(trace) if ours != theirs), None)
    assert first is None, f"after flag {first}: ours {trace[first][0]}, GradScaler's {trace[first][1]}"
    scales = [ours[0] for ours, _ in trace]
    steps = list(itertools.pairwise(scales))
    assert any(b < a for a, b in steps) and any(b > a for a, b in steps)  # backed off and grew
    assert trace[-1][0] == (scales[-11] * 4, 0)  # two growths in the 10 good steps after the last overflow


def test_float32_range_as_grad_scalers_tensor() -> None:
    top = run_both([False] * INTERVAL, ScalerState(scale=2.0 ** 127, growth_tracker=0))
    assert top[-1][0] == top[-1][1] == (2.0 ** 127, 0)  # 2**128 is Inf in float32: not taken
    bottom = run_both([True], ScalerState(scale=2.0 ** -149))  # float32's least: half of it is 0
    assert bottom[-1][0] == bottom[-1][1] == (0.0, 0)


def test_resumes_from_a_saved_state() -> None:
    trace = run_both([False] * 10, ScalerState(scale=2.0 ** 10, growth_tracker=INTERVAL - 4))
    assert trace[3][0] == (2.0 ** 11, 0) and all(ours == theirs for ours, theirs in trace)


def test_the_state_round_trips_through_trainer_json() -> None:
    trainer = TrainerState(job="j", step=4, epoch=1, offset=0, global_batch=16, num_samples=64, seed=0,
                           shuffle=False, plan="p", saved_at=0.0,
                           scaler=ScalerState(scale=2.0 ** 15, growth_tracker=1))
    back = TrainerState.model_validate_json(trainer.model_dump_json())
    assert back == trainer and LossScaler(back.scaler).state() == trainer.scaler
    legacy = trainer.model_dump(exclude={"scaler"})  # a checkpoint saved before fp16 existed, or in fp32
    assert TrainerState.model_validate(legacy).scaler is None


def replies(*nonfinite: list[str]) -> list[tuple[_Service, StepReply]]:
    return [(_Service(f"w{s}", f"c-s{s}", 0, s),
             StepReply(step=0, stage=s, losses=[1.0], nonfinite_grads=names))
            for s, names in enumerate(nonfinite)]


def test_an_overflow_is_a_skipped_step_and_a_backoff_not_a_failure() -> None:
    scaler = LossScaler()
    assert not overflowed("run", 0, replies([], []), scaler, last_good=None)
    assert (scaler.scale, scaler.growth_tracker) == (2.0 ** 16, 1)
    assert overflowed("run", 1, replies([], ["cell1.weight"]), scaler, last_good=(0, 1.0))
    assert (scaler.scale, scaler.growth_tracker) == (2.0 ** 15, 0)


def test_a_scale_backed_off_to_zero_stops_the_job_naming_the_gradients() -> None:
    scaler = LossScaler(ScalerState(scale=2.0 ** -149))
    says = r"step 8: the gradients of cell0.bias on stage 0 are not finite at loss scale 1.4013e-45, and the "
    with pytest.raises(NonFiniteStep, match=says + "scale has backed off to 0") as info:
        overflowed("run", 7, replies(["cell0.bias"]), scaler, last_good=(3, 0.5))
    assert (info.value.step, info.value.last_good_loss) == (7, 0.5)
