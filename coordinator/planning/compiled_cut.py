"""The min-max cut's programme compiled (numba): the band's very answer, an order quicker at cluster size.

[Note: the compiled programme] :func:`cutting.cut_min_max`'s programme over (stages, end node) is a
loop of a few comparisons per (stage, end, start); the band (``cutting._banded``) runs it as numpy
passes, a stage at a time, over an ``n x w`` block of starts, and at cluster size those passes were
most of a plan's search: 429 cuts within memory took about 6 s of seed 12's 6.4 s (1,000 nodes over
1,024 workers, docs/benchmarks.md). Compiled, the same loop visits only the starts that can still win:

- for each end ``j`` the starts go down from ``j - 1``, and stop at the first whose compute and ``j``'s
  transfer alone pass the best value found for ``j`` (a further start adds compute, and its own
  transfer is never negative) or the try's bound; or whose stage exceeds its memory (a stage's bytes
  only grow as its start moves back);
- the ends of stage ``s`` are those the stages before it reached (the finite values' first and last)
  and, under a bound ``U``, those whose compute before and after fits ``U`` per stage at each stage's
  pace, less the cheapest cuts the stages pay ([Note: the ends' window] and [Note: the ends' window, with
  the cuts paid] in ``cutting.py``).

Every value and every choice at or under ``U`` is the dense programme's, with the same float operations
in the same order and the same ties (the earliest start), so the boundaries are the band's (the tests
hold the two equal on random chains with every memory term, paces and forbidden cuts). The tries go as
the band's do: ``U`` from 1.15 times the least possible bottleneck; a try whose answer passed its ``U``
still found a cut, whose slowest stage is the next ``U`` (which then holds); a try that found none widens
``U`` (the last is unbounded). Whether any cut fits memory is decided first, in ``O(k n)``
(:func:`_fits`, ``cutting.fits_memory`` compiled).

numba compiles the two loops on their first call (about a second) and keeps the code in its cache
(``__pycache__`` beside this file where that is writable, else the user's cache directory, or
``NUMBA_CACHE_DIR``), so a later process loads it in about 0.1 s. In the image (``k8s/Dockerfile``: the
packages read-only, ``HOME=/tmp``) that is ``/tmp/.cache/numba``, so a pod compiles once, on the first
search that needs the programme.
``cutting.cut_min_max`` takes this path only for chains large enough to repay that
(:data:`COMPILED_FROM`), and once the band has spent :data:`BAND_BUDGET_S` on them; the examples' chains
never import numba. numba comes with the ``fast`` extra (``pip install 'cellmesh[fast]'``); where it cannot
be imported, the band serves every cut.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from coordinator.planning.cutting import Bounds, CutProblem

__all__ = ["BAND_BUDGET_S", "COMPILED_FROM", "available", "band_spent", "cut", "programme_under", "wanted"]

log = logging.getLogger(__name__)

# The least ``nodes x stages`` cut here: smaller chains stay on the band (a plan of a few dozen nodes never
# pays numba's import or a first compile).
COMPILED_FROM = 2048

# [Note: the band first, then the compiled programme] numba costs a process 0.25-0.4 s of CPU before its
# first cut (its import, 0.15-0.27 s, and LLVM's start on the first call, 0.1-0.15 s), which is more than a
# quick search on a cluster's list cuts in all (0.3-0.7 s searches on seven of sixteen random lists of 1,024
# workers). So a process cuts its long chains on the band until the band has spent this much CPU on them,
# and then loads the compiled programme: a search that would have paid the load spends at most as much
# again on the band first (renting until the rent reaches the price), and one that cuts little never pays
# it. The boundaries are the same either way.
BAND_BUDGET_S = 0.3
_band_spent = 0.0  # the band's CPU seconds on chains of at least COMPILED_FROM, in this process

# The bounds the tries put on the bottleneck, in multiples of the least it can be (as the band's)
_TRIES = (1.15, 1.5, 6.0, math.inf)

_kernels: tuple[Callable[..., Any], Callable[..., Any]] | None = None
_unavailable = ""  # why numba could not be used ("" until tried, or where it can)


def wanted(problem: CutProblem) -> bool:
    """Whether ``problem`` goes to the compiled programme: long enough, past the band's budget, and numba
    there ([Note: the band first, then the compiled programme])."""
    k = problem.num_stages
    if k < 2 or problem.num_nodes * k < COMPILED_FROM:
        return False
    return (_kernels is not None or _band_spent >= BAND_BUDGET_S) and available()


def band_spent(seconds: float, problem: CutProblem) -> None:
    """Counts ``seconds`` of the band's CPU on ``problem`` towards the budget, if it is a long chain."""
    global _band_spent
    if problem.num_stages > 1 and problem.num_nodes * problem.num_stages >= COMPILED_FROM:
        _band_spent += seconds


def available() -> bool:
    """Whether the compiled programme can run here (numba imports); imports it on the first call."""
    global _kernels, _unavailable
    if _kernels is None and not _unavailable:
        try:
            import numba
        except Exception as exc:  # ImportError, or a numba that does not support this numpy / Python
            _unavailable = f"{type(exc).__name__}: {exc}"
            log.info("cutting long chains without the compiled programme (numba: %s); the band is exact, "
                     "only slower: pip install 'cellmesh[fast]' for it", _unavailable)
        else:
            compile_ = numba.njit(cache=True, nogil=True)
            _kernels = (compile_(_programme), compile_(_fits))
    return _kernels is not None


def cut(problem: CutProblem, least: float) -> Bounds | None:
    """The exact min-max cut of ``problem`` (the boundaries ``cutting.cut_min_max`` gives), or None where no
    cut fits its memory and cuttable positions. ``least``: a lower bound on the slowest stage (where the
    tries start). Call only where :func:`available`."""
    assert _kernels is not None, "compiled_cut.cut called where numba is not available"
    arrays = _Arrays(problem)
    if arrays.memory and not _kernels[1](arrays.allowed, problem.num_stages, *arrays.memory_terms()):
        return None
    found = math.inf  # the slowest stage of a cut a try found past its bound: the optimum is at most that
    for factor in _TRIES:
        limit = min(factor * least if least > 0 else math.inf, found)
        bounds, final = _under(problem, arrays, limit)
        if bounds is not None or math.isinf(limit):
            return bounds  # None under no bound: no cut exists
        found = min(found, final)
    return None  # not reached: the last try is unbounded


def programme_under(problem: CutProblem, limit: float) -> Bounds | None:
    """The programme's boundaries under the bound ``limit`` alone (None where its answer passes it): what
    ``cutting._banded(problem, limit)`` gives, for the tests."""
    assert available(), "compiled_cut.programme_under called where numba is not available"
    return _under(problem, _Arrays(problem), limit)[0]


def _under(problem: CutProblem, arrays: _Arrays, limit: float) -> tuple[Bounds | None, float]:
    """One try: the boundaries where the programme's answer is within ``limit`` (else None), and its answer
    (inf: it found no cut within the try's window)."""
    assert _kernels is not None
    n, k = problem.num_nodes, problem.num_stages
    final, choice = _kernels[0](problem._prefix, arrays.w, arrays.allowed, arrays.pace, k, arrays.memory,
                                *arrays.memory_terms(), limit, *_windows(problem, arrays, limit))
    if not (math.isfinite(final) and final <= _cap(limit)):
        return None, final
    bounds = [n]
    for s in range(k - 1, 0, -1):
        bounds.append(int(choice[s, bounds[-1]]))
    bounds.append(0)
    return tuple(reversed(bounds)), final


def _windows(problem: CutProblem, arrays: _Arrays, limit: float) -> tuple[np.ndarray, np.ndarray]:
    """Per stage, the ends ``[lo, hi)`` that can lead to an answer within ``limit``: the band's own
    (``cutting._ends_windows``), every end under no bound."""
    from coordinator.planning.cutting import _ends_windows

    n, k = problem.num_nodes, problem.num_stages
    if math.isinf(limit):
        return np.zeros(k, dtype=np.int64), np.full(k, n + 1, dtype=np.int64)
    lo, hi = _ends_windows(problem, limit, arrays.w, arrays.allowed)
    return lo.astype(np.int64), hi.astype(np.int64)


def _cap(limit: float) -> float:
    """A try's bound with a margin for the sums' rounding (the band's)."""
    return limit * (1 + 1e-9) + 1e-12


class _Arrays:
    """A problem's terms as the compiled loops take them (contiguous arrays; flags for the terms it lacks)."""

    def __init__(self, problem: CutProblem) -> None:
        from coordinator.planning.cutting import with_slack

        n, k = problem.num_nodes, problem.num_stages
        self.w = np.asarray(problem.cut_s, dtype=np.float64).copy()
        self.w[0] = self.w[n] = 0.0
        self.allowed = np.ones(n + 1, dtype=np.bool_)
        if problem.cuttable is not None:
            self.allowed = np.asarray(problem.cuttable, dtype=np.bool_).copy()
            self.allowed[0] = self.allowed[n] = True
        self.pace = np.asarray(problem.pace or (1.0,) * k, dtype=np.float64)
        self.memory = problem.memory_limit is not None
        zeros = np.zeros(n + 1)
        self.static, self.transient, self.hold = zeros, zeros[:n], zeros
        self.has_transient = self.has_hold = False
        self.held = np.zeros((2, n + 1))  # the prefix sums of the (at most two) held bytes the stages take
        self.held_row = np.full(k, -1, dtype=np.int64)
        self.in_flight = np.zeros(k)
        self.room = np.zeros(k)
        self.holds = np.zeros(k, dtype=np.bool_)
        if not self.memory:
            return
        assert problem.static_bytes is not None and problem.memory_limit is not None
        assert problem.in_flight is not None
        self.static = np.concatenate([[0.0], np.cumsum(problem.static_bytes)])
        if problem.transient_bytes is not None and any(problem.transient_bytes):
            self.transient = np.asarray(problem.transient_bytes, dtype=np.float64)
            self.has_transient = True
        if problem.hold_bytes is not None and any(problem.hold_bytes):
            self.hold = np.concatenate([[0.0], np.cumsum(problem.hold_bytes)])
            self.has_hold = True
        rows: dict[int, int] = {}  # by identity: the problem keeps each held tuple once
        for s in range(k):
            held = problem.held_bytes(s)
            if held is None:
                continue
            if id(held) not in rows:
                rows[id(held)] = len(rows)
                self.held[rows[id(held)]] = np.concatenate([[0.0], np.cumsum(held)])
            self.held_row[s] = rows[id(held)]
            self.in_flight[s] = problem.in_flight[s]
            self.room[s] = with_slack(problem.memory_limit[s])
            self.holds[s] = problem.holds is not None and problem.holds[s]

    def memory_terms(self) -> tuple[Any, ...]:
        return (self.static, self.transient, self.has_transient, self.hold, self.has_hold, self.held,
                self.held_row, self.in_flight, self.room, self.holds)


def _programme(prefix: np.ndarray, w: np.ndarray, allowed: np.ndarray, pace: np.ndarray, k: int,
               memory: bool, static: np.ndarray, transient: np.ndarray, has_transient: bool,
               hold: np.ndarray, has_hold: bool, held: np.ndarray, held_row: np.ndarray,
               in_flight: np.ndarray, room: np.ndarray, holds: np.ndarray,
               limit: float, window_lo: np.ndarray, window_hi: np.ndarray) -> tuple[float, np.ndarray]:
    """The programme under the bound ``limit`` ([Note: the compiled programme]): the slowest stage of the
    best cut it found (inf: none) and, per stage and end, the start chosen. Exact where that value is at
    most :func:`_cap` of ``limit``."""
    n = prefix.shape[0] - 1
    prev = np.full(n + 1, np.inf)  # the best of the stages so far, per end
    cur = np.full(n + 1, np.inf)
    choice = np.zeros((k, n + 1), np.int64)
    cap = limit * (1 + 1e-9) + 1e-12
    prev[0] = 0.0  # before stage 0: nothing, ending at node 0
    first_end, last_end = 0, 0  # the finite values of ``prev``
    for s in range(k):
        pace_s = pace[s]
        row = held_row[s]
        metered = memory and row >= 0
        # the ends the bound's window leaves ([Note: the ends' window], with the cuts paid), and those after
        # a start the stages before reached and before the stages after it have a node each
        lo, hi = max(s + 1, first_end + 1, window_lo[s]), min(n - (k - 1 - s), window_hi[s] - 1)
        if s == k - 1:
            lo = n
        cur[:] = np.inf
        for j in range(lo, hi + 1):
            if (prefix[j] - prefix[last_end]) * pace_s > cap:
                break  # no start the stages before reached is within the bound of this end, or a later one
            if not allowed[j]:
                continue
            best = np.inf
            chosen = -1
            wj = w[j]
            top = min(j - 1, last_end)
            most = 0.0  # the transient bytes' largest over the stage's nodes
            if metered and has_transient:
                for g in range(top + 1, j):
                    most = max(most, transient[g])
            for i in range(top, first_end - 1, -1):
                base = (prefix[j] - prefix[i]) * pace_s
                if base + wj > best or base + wj > cap:
                    break  # every earlier start costs at least this
                if metered:
                    if has_transient:
                        most = max(most, transient[i])
                    used = static[j] - static[i]
                    if has_transient:
                        used = used + most
                    if has_hold and holds[s]:
                        used = used + (hold[j] - hold[i])
                    if used + (held[row, j] - held[row, i]) * in_flight[s] > room[s]:
                        break  # and every earlier start holds more
                if not allowed[i]:
                    continue
                before = prev[i]
                if before == np.inf:
                    continue
                cost = base + w[i] + wj
                value = before if before > cost else cost
                if value <= best:  # going down: the earliest start of equal values wins, as the band's
                    best = value
                    chosen = i
            if chosen >= 0:
                cur[j] = best
                choice[s, j] = chosen
        first_end, last_end = n + 1, -1
        for j in range(n + 1):
            prev[j] = cur[j]
            if cur[j] < np.inf:
                first_end = min(first_end, j)
                last_end = j
        if last_end < 0:
            return np.inf, choice
    return prev[n], choice


def _fits(allowed: np.ndarray, k: int, static: np.ndarray, transient: np.ndarray, has_transient: bool,
          hold: np.ndarray, has_hold: bool, held: np.ndarray, held_row: np.ndarray, in_flight: np.ndarray,
          room: np.ndarray, holds: np.ndarray) -> bool:
    """``cutting.fits_memory`` compiled: stage by stage, an end is reachable when the latest reachable start
    before it fits; the transient bytes' largest over a stage from a table of every power-of-two run."""
    n = static.shape[0] - 1
    levels = 1
    while (1 << levels) <= n:
        levels += 1
    floor_log = np.zeros(n + 1, np.int64)  # floor(log2(length)) for every length a stage can have
    for length in range(2, n + 1):
        floor_log[length] = floor_log[length // 2] + 1
    table = np.zeros((levels if has_transient else 1, n + 1))
    if has_transient:
        table[0, :n] = transient
        for level in range(1, levels):
            half = 1 << (level - 1)
            for i in range(n - (1 << level) + 1):
                table[level, i] = max(table[level - 1, i], table[level - 1, i + half])
    reach = np.zeros(n + 1, np.bool_)
    reach[0] = True
    following = np.zeros(n + 1, np.bool_)
    for s in range(k):
        latest = -1
        row = held_row[s]
        for j in range(n + 1):
            following[j] = False
            if j > 0 and reach[j - 1]:
                latest = j - 1
            if latest < 0 or not allowed[j] or (s < k - 1 and j == n):
                continue
            used = static[j] - static[latest]
            if has_transient:
                level = floor_log[j - latest]
                used = used + max(table[level, latest], table[level, j - (1 << level)])
            if has_hold and holds[s]:
                used = used + (hold[j] - hold[latest])
            if row >= 0:
                used = used + (held[row, j] - held[row, latest]) * in_flight[s]
            following[j] = used <= room[s]
        reach[:] = following
    return bool(reach[n])
