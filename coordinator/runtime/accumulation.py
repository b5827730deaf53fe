"""Gradient accumulation: the global batches of one optimizer step and the action lists that run them.

With ``optimizer.accumulate: A`` a step (one optimizer update; [Note: optimizer steps] in
``coordinator/planning/config.py``) trains on the global batches ``k A .. k A + A - 1`` of the
sampler. Each is split into the plan's replicas and microbatches exactly as alone, and replica
``r`` gets the ``A M`` microbatches of its shares, in order (:func:`step_batches`). All of them
run in ONE ``run_step`` per stage, so:

* the gradient is the one of the mean loss over the ``A B`` samples, which is what a torch loop
  computes when it divides each global batch's mean loss by ``A`` (the batches are equal): the
  executor weighs microbatch ``m`` by ``n_m / N`` with ``N`` the replica's samples in the step
  (``services/compute/executor.py``), and the replicas' all-reduce MEAN (or the shards'
  average) does the rest;
* the replicas synchronise once per optimizer step, not once per global batch: the all-reduce
  is armed before the stage's last backward of the step, and the parameter-server push goes
  out with the commit;
* a step still costs one round trip, commit included.

The action list of a step (:func:`accumulated_schedule`) is the plan's schedule over ``A M``
microbatches when that keeps every stage's peak of microbatches in flight (1F1B: at most ``p - s``,
whatever the count), which also shrinks the pipeline's bubble to ``(p - 1) / (A M + p - 1)``;
otherwise (GPipe, whose peak is every microbatch of the list; an interleaved schedule whose
``A M`` it refuses or whose groups grow) the plan's list repeated ``A`` times over consecutive
microbatches, so the activations held stay those of one global batch: accumulation is how a
model trains on a batch whose activations do not fit. Stages sharing a worker repeat their
merged order the same way (``Schedule.order``).
"""

from __future__ import annotations

from coordinator.planning.data import BatchSampler, split_batch
from coordinator.planning.schedules import Schedule, build_schedule, peak_in_flight, schedule_problem
from services.protocol import Action

__all__ = ["accumulated_schedule", "step_batches"]


def step_batches(sampler: BatchSampler, step: int, accumulate: int, data_parallel: int,
                 num_microbatches: int) -> list[list[list[int]]]:
    """Step ``step``'s samples as ``[replica][microbatch]``: its ``accumulate`` global batches, each split
    into ``data_parallel`` replicas of ``num_microbatches`` microbatches, concatenated per replica.

    Raises:
        ValueError: The global batch does not split into the replicas and microbatches.
    """
    if accumulate == 1:  # the sampler's global batch, split
        return split_batch(sampler.indices(step), data_parallel, num_microbatches)
    out: list[list[list[int]]] = [[] for _ in range(data_parallel)]
    for a in range(accumulate):
        for r, shares in enumerate(split_batch(sampler.indices(step * accumulate + a), data_parallel,
                                               num_microbatches)):
            out[r] += shares
    return out


def accumulated_schedule(one: Schedule, accumulate: int) -> Schedule:
    """Every stage's action list for a step of ``accumulate`` global batches run by the plan's schedule
    ``one`` (see the module docstring).

    Raises:
        ValueError: ``accumulate`` is below 1.
    """
    if accumulate < 1:
        raise ValueError(f"accumulate must be >= 1, got {accumulate}")
    if accumulate == 1:
        return one
    m = one.num_microbatches
    chunks = one.num_stages // one.num_ranks  # stages per worker (interleaved schedules)
    if schedule_problem(one.name, one.num_stages, m * accumulate, chunks) is None:
        longer = build_schedule(one.name, one.num_stages, m * accumulate, chunks)
        if all(peak_in_flight(a) <= peak_in_flight(b)
               for a, b in zip(longer.actions, one.actions, strict=True)):
            return longer

    def repeat(lists: tuple[tuple[Action, ...], ...]) -> tuple[tuple[Action, ...], ...]:
        return tuple(tuple(Action(stage=act.stage, kind=act.kind, microbatch=act.microbatch + k * m)
                           for k in range(accumulate) for act in acts) for acts in lists)

    return Schedule(f"{one.name}x{accumulate}", m * accumulate, repeat(one.actions), one.ranks,
                    repeat(one.order))
