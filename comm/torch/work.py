"""The handle of one c10d operation, and the steps that land its result in the caller's tensors."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta

import torch

from comm.base import Work, bound
from comm.torch.completion import Completion
from comm.torch.guard import GroupGuard

__all__ = ["TorchWork", "copier", "finisher"]


class TorchWork(Work):
    """A handle on one c10d operation; ``wait`` follows [Note: never block in c10d's wait].

    Results (copies back into non-contiguous tensors, MEAN's division) land in the
    caller's tensors when ``wait`` returns, not merely when ``is_completed`` turns True.
    """

    def __init__(
        self,
        guard: GroupGuard,
        op: str,
        completion: Completion,
        *,
        peers: Sequence[int],
        waiting_for: int | None,
        timeout: timedelta,
        finish: Callable[[], None] | None,
    ) -> None:
        self._guard = guard
        self._op = op
        self._completion = completion
        self._peers = peers
        self._waiting_for = waiting_for
        self._timeout = timeout
        self._finish = finish
        self._waited = False
        self._error: BaseException | None = None

    def wait(self, timeout: timedelta | None = None) -> None:
        if self._waited:
            if self._error is not None:
                raise self._error
            return
        try:
            self._guard.wait(
                self._completion, self._op, self._peers, bound(timeout, self._timeout), self._waiting_for
            )
            if self._finish is not None:
                self._finish()
        except BaseException as exc:
            self._error = exc
            raise
        finally:
            self._waited = True

    def is_completed(self) -> bool:
        return self._waited or self._completion.poll()


def copier(dst: torch.Tensor, src: torch.Tensor) -> Callable[[], None]:
    """Copy a staged receive buffer back into the caller's (non-contiguous) tensor."""
    def finish() -> None:
        dst.copy_(src)

    return finish


def finisher(dst: torch.Tensor, buf: torch.Tensor, divide_by: int | None) -> Callable[[], None] | None:
    """What to do after the op: divide (emulated MEAN) and copy back into a staged tensor."""
    if divide_by is None and buf is dst:
        return None

    def finish() -> None:
        if divide_by is not None:
            buf.div_(divide_by)
        if buf is not dst:
            dst.copy_(buf)

    return finish
