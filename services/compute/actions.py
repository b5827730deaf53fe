"""Validation of one stage's action list before anything runs: order, peers, and coverage per microbatch.

The compute service executes the list it is given and never reorders it; this module
only refuses lists it could not execute. Checks are local to one stage (a mismatch
between two stages' lists, say a send nobody receives, shows up as a receive timeout
naming the peer). For every microbatch ``m`` of the step, a valid list has::

    recv_act(m)  <  forward(m)  <  send_act(m)            (forward: exactly once)
    recv_grad(m) <  backward(m) <  send_grad(m)           (backward: at most once, after forward(m))

where ``recv_act``/``send_grad`` exist exactly on stages with a previous stage and
``send_act``/``recv_grad`` exactly on stages with a next stage, the gradient transfers
only when ``backward(m)`` is in the list (a list without backwards is an evaluation
step), and every transfer names the neighbouring stage as its peer. ``<`` is the
position in the list; ``recv_grad(m)`` may come before ``forward(m)`` (its buffers are
known from the plan), which lets a schedule post gradient receives early.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.protocol import StageAction

__all__ = ["ActionListError", "validate_actions"]

# (earlier, later): a microbatch's `later` action needs its `earlier` action before it
_ORDER = (("recv_act", "forward"), ("forward", "send_act"), ("forward", "backward"),
          ("recv_grad", "backward"), ("backward", "send_grad"))


class ActionListError(ValueError):
    """An action list this stage cannot execute; the message names the stage and the action."""


def validate_actions(actions: Sequence[StageAction], *, stage: int, num_stages: int,
                     num_microbatches: int) -> frozenset[int]:
    """Check ``actions`` for stage ``stage`` of ``num_stages``; return the microbatches that run backward.

    Raises:
        ActionListError: A microbatch out of range, a wrong or missing peer, an action
            repeated or missing, or two actions of one microbatch in the wrong order.
    """
    first, last = stage == 0, stage == num_stages - 1
    expected_peer = {"recv_act": stage - 1, "send_grad": stage - 1, "send_act": stage + 1,
                     "recv_grad": stage + 1, "forward": None, "backward": None}
    position: dict[tuple[str, int], int] = {}
    for k, action in enumerate(actions):
        where = f"stage {stage}, action #{k} ({action})"
        if action.microbatch >= num_microbatches:
            raise ActionListError(f"{where}: microbatch {action.microbatch} is not one of the step's "
                                  f"{num_microbatches} microbatches")
        if action.kind in ("recv_act", "send_grad") and first:
            raise ActionListError(f"{where}: stage {stage} is the first stage; it has no previous stage")
        if action.kind in ("send_act", "recv_grad") and last:
            raise ActionListError(f"{where}: stage {stage} is the last of {num_stages}; it has no next stage")
        peer = expected_peer[action.kind]
        if action.peer != peer:
            raise ActionListError(f"{where}: {action.kind} needs peer {peer}, got {action.peer}")
        key = (action.kind, action.microbatch)
        if key in position:
            raise ActionListError(f"{where}: repeats action #{position[key]} ({action.kind} of microbatch "
                                  f"{action.microbatch} runs at most once per step)")
        position[key] = k
    with_backward = frozenset(m for kind, m in position if kind == "backward")
    for m in range(num_microbatches):
        required = {"forward"}
        if not first:
            required |= {"recv_act"} | ({"send_grad"} if m in with_backward else set())
        if not last:
            required |= {"send_act"} | ({"recv_grad"} if m in with_backward else set())
        for kind in ("forward", "backward", "recv_act", "send_act", "recv_grad", "send_grad"):
            present = (kind, m) in position
            if kind in required and not present:
                raise ActionListError(f"stage {stage}: microbatch {m} has no {kind} action" + (
                    "" if kind in ("forward", "recv_act", "send_act") else " (it runs backward)"))
            if kind in ("recv_grad", "send_grad") and present and m not in with_backward:
                raise ActionListError(f"stage {stage}: microbatch {m} has {kind} but no backward")
        for earlier, later in _ORDER:
            a, b = position.get((earlier, m)), position.get((later, m))
            if a is not None and b is not None and a > b:
                raise ActionListError(
                    f"stage {stage}, action #{b} ({actions[b]}): {later} of microbatch {m} comes before "
                    f"its {earlier} (action #{a}, {actions[a]})"
                )
    return with_backward
