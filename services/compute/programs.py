"""A compute stage's step programs: each validated once on receipt, then looked up by the steps naming it.

See [Note: step programs] in ``services/protocol/compute.py``. :class:`Programs` belongs to one
compute service and is used from its host thread only (``load_program`` and ``run_step`` are
validated there, before a step reaches the step thread), so it needs no lock. A step naming a
program runs as the :class:`~services.protocol.RunStep` with the program's fields copied in
(:data:`~services.protocol.PROGRAM_FIELDS`): the executor sees one kind of request either way.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.compute.actions import validate_stage
from services.compute.stage import Stage, check_eval
from services.protocol import MAX_PROGRAMS, PROGRAM_FIELDS, LoadProgram, RunStep, StepProgram

__all__ = ["Programs", "UnknownProgram", "check_program"]


class UnknownProgram(ValueError):
    """A step names a program the stage does not hold (the message names the fix)."""


def check_program(stage: Stage, batch_norm: list[str], program: StepProgram, num_microbatches: int) -> bool:
    """Check ``program``'s per-plan fields on ``stage`` for steps of ``num_microbatches`` microbatches.

    ``batch_norm`` names the stage's BatchNorm layers (such a stage trains one microbatch per step:
    [Note: BatchNorm sees the global batch] in ``services/compute/batchnorm.py``).

    Returns:
        True if the list trains (runs every microbatch's backward), False if it only evaluates.

    Raises:
        ValueError: A ``ScheduleError`` naming the broken rule, an evaluation list with a backward (or
            on a stage without held-out data), or several microbatches on a stage with BatchNorm.
    """
    trains = validate_stage(program.actions, stage=stage.index, num_stages=stage.num_stages,
                            num_microbatches=num_microbatches)
    if program.source == "eval":
        check_eval(stage, trains)
    if trains and batch_norm and num_microbatches > 1:
        raise ValueError(f"{num_microbatches} microbatches would each be normalised on their own by "
                         f"BatchNorm layer {batch_norm[0]}: a step of a model with BatchNorm takes one "
                         "microbatch per replica")
    return trains


@dataclass(frozen=True)
class _Held:
    program: LoadProgram
    trains: bool
    fields: dict[str, object]  # what a step naming it takes from it (PROGRAM_FIELDS)


class Programs:
    """The programs one stage holds, by name (at most :data:`~services.protocol.MAX_PROGRAMS`)."""

    def __init__(self, stage: Stage, batch_norm: list[str]) -> None:
        self._stage = stage
        self._batch_norm = batch_norm
        self._held: dict[str, _Held] = {}

    def load(self, request: LoadProgram) -> None:
        """Check ``request`` and hold it under its name (replacing a program of that name).

        Raises:
            ValueError: It fails :func:`check_program` (nothing is held under its name then, not even a
                program held there before), or the stage holds ``MAX_PROGRAMS`` others already.
        """
        self._held.pop(request.program, None)
        if len(self._held) >= MAX_PROGRAMS:
            raise ValueError(f"the stage holds {len(self._held)} programs already ({sorted(self._held)}), "
                             f"the most it keeps: load under one of those names to replace it")
        trains = check_program(self._stage, self._batch_norm, request, request.num_microbatches)
        self._held[request.program] = _Held(request, trains, {f: getattr(request, f) for f in PROGRAM_FIELDS})

    def resolve(self, request: RunStep) -> tuple[RunStep, bool]:
        """The step to run (``request`` with its program's fields, if it names one) and whether it trains.

        Raises:
            UnknownProgram: It names a program the stage does not hold.
            ValueError: Its own fields fail :func:`check_program`, or its microbatches are not as many as
                its program's.
        """
        if request.program is None:
            return request, check_program(self._stage, self._batch_norm, request, len(request.microbatches))
        held = self._held.get(request.program)
        if held is None:
            raise UnknownProgram(f"stage {self._stage.index} holds no program {request.program!r} (it holds "
                                 f"{sorted(self._held) or 'none'}): send it with load_program first (a stage "
                                 "placed anew holds none), or send the step with its actions")
        if len(request.microbatches) != held.program.num_microbatches:
            raise ValueError(f"program {request.program!r} runs {held.program.num_microbatches} "
                             f"microbatches, the step brings {len(request.microbatches)}")
        return request.model_copy(update=held.fields), held.trains
