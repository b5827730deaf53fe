"""The stage's optimizer: torch's fused implementation where there is one, the same steps as the default."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from services.compute.stage import make_optimizer
from services.protocol import OptimizerSpec


def _steps(name: str, kwargs: dict[str, Any],
           fused: bool) -> tuple[torch.optim.Optimizer, list[torch.Tensor]]:
    """5 steps over three float64 tensors (one of them empty, as a short shard is), fixed gradients."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(7, 5, dtype=torch.float64, generator=gen).requires_grad_(),
              torch.randn(3, dtype=torch.float64, generator=gen).requires_grad_(),
              torch.zeros(0, 4, dtype=torch.float64, requires_grad=True)]
    opt = make_optimizer(OptimizerSpec(name=name, kwargs=kwargs), params, fused=fused)
    for _ in range(5):
        for p in params:
            p.grad = torch.randn(p.shape, dtype=p.dtype, generator=gen)
        opt.step()
    return opt, params


@pytest.mark.parametrize(("name", "kwargs"), [
    ("AdamW", {"lr": 0.01, "weight_decay": 0.1}), ("Adam", {"lr": 0.01, "amsgrad": True}),
    ("SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}), ("SGD", {"lr": 0.1}),
    ("Adagrad", {"lr": 0.1})])
def test_the_fused_optimizer_steps_as_torchs_default(name: str, kwargs: dict[str, Any]) -> None:
    fused, mine = _steps(name, kwargs, fused=True)
    default, theirs = _steps(name, kwargs, fused=False)
    assert all(g["fused"] for g in fused.param_groups)
    assert not any(g.get("fused") for g in default.param_groups)
    assert max(float((a - b).detach().abs().max()) for a, b in zip(mine[:2], theirs[:2], strict=True)) < 1e-14
    start = torch.randn(7, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert float((mine[0].detach() - start).abs().max()) > 1e-3  # they moved


def test_a_users_choice_of_implementation_and_a_class_without_fused_are_kept() -> None:
    opt, _ = _steps("AdamW", {"lr": 0.01, "foreach": True}, fused=True)
    assert opt.param_groups[0]["foreach"] is True and not opt.param_groups[0]["fused"]
    opt, _ = _steps("RMSprop", {"lr": 0.01}, fused=True)  # no fused kernel: torch's default
    assert isinstance(opt, torch.optim.RMSprop)
    with pytest.raises(ValueError, match="optimizer AdamW"):
        make_optimizer(OptimizerSpec(name="AdamW", kwargs={"lr": -1.0}), [torch.zeros(2, requires_grad=True)],
                       fused=True)
