"""``cellmesh plan JOB``: the plan a run would use and its predicted step, without starting a worker.

It loads the job as ``cellmesh run`` does (the same config flags: ``--workers 4``,
``--stages 2``...), profiles it on a sample microbatch in this process, asks the planner,
and prints the plan's table and the simulator's per-stage summary of one step
(``coordinator/planning/prediction.py``). ``--timeline FILE`` draws that predicted step
(``draw_timeline``: ``.svg`` with no dependency, ``.png``/``.pdf`` with matplotlib, the
``plot`` extra). The same prediction sits beside the measured steps in a run's trace.

It is also the dry run for a cluster: ``--resources FILE`` plans for the workers a resource file
lists (``coordinator/planning/resource_file.py``: hosts of several workers, the links inside and
between them) instead of this machine's ``runtime.workers``, and the plan's table names the
worker of each stage (``coordinator/planning/placement.py``). ``--runners-up N`` prints the N
fastest plans the planner weighed (default 5; 0: none), which costs one more search.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from coordinator.commands.jobspec import load_job
from coordinator.commands.output import apply_logging
from coordinator.commands.run import REPORTED, report
from coordinator.planning.planner import format_candidates
from coordinator.planning.prediction import predict
from coordinator.planning.resource_file import load_resources
from coordinator.planning.simulator import draw_timeline
from coordinator.planning.timeline_plot import check_drawable
from coordinator.runtime.job import Job

__all__ = ["plan_command"]


DEFAULT_RUNNERS_UP = 5


def plan_command(job: str, settings: Mapping[str, Any], timeline: Path | None, *, out: TextIO | None = None,
                 show_traceback: bool = False, resources: Path | None = None,
                 runners_up: int = DEFAULT_RUNNERS_UP) -> int:
    """Print ``job``'s plan and predicted step (for the workers of the ``resources`` file if given), the
    ``runners_up`` fastest plans weighed; draw the step to ``timeline`` if given. Returns the exit code."""
    out = out or sys.stdout
    try:
        if timeline is not None:
            check_drawable(timeline)  # before the profiling, not after
        listed = load_resources(resources) if resources is not None else None  # before the profiling too
        loaded = load_job(job, settings)
        apply_logging(loaded.job.config.logging)
        planned = loaded.job if listed is None else Job(loaded.job.config, resources=listed)
        print(f"resources: {planned.resources.summary()}", file=out, flush=True)
        if crowded := planned.resources.crowded_hosts():
            print(_crowded_note(crowded), file=out, flush=True)
        plan = planned.plan()
        if planned.search_s is not None:
            hint = f"; {planned.search_hint}" if planned.search_hint else ""
            print(f"the planner's search took {planned.search_s:.2f} s{hint}", file=out, flush=True)
        result = predict(plan)
        print(f"{plan}\n\npredicted step of the schedule (simulated, before gradient sync and messages):\n"
              f"{result.summary()}", file=out, flush=True)
        if planned.weighed is not None:  # [Note: the plan's own size] in coordinator/runtime/job.py
            print(f"\npriced on timings at its own microbatch size ({plan.microbatch_size} samples); the "
                  f"search weighed it at {planned.weighed.step_time_s * 1e3:.3f} ms on the sample's profile, "
                  "as it weighed every plan", file=out, flush=True)
        if runners_up > 0:
            print(f"\nrunners-up (the {runners_up} fastest plans weighed, fitting ones first):\n"
                  f"{format_candidates(planned.candidates(limit=runners_up), limit=runners_up)}", file=out,
                  flush=True)
        if timeline is not None:
            title = (f"{loaded.name}: {plan.summary()}; pipeline {result.step_time_s * 1e3:.3f} ms, "
                     f"bubble {result.bubble_fraction:.1%}")
            draw_timeline(result, timeline, title=title)
            print(f"predicted timeline written to {timeline}", file=out, flush=True)
    except REPORTED as exc:
        return report(exc, show_traceback=show_traceback)
    return 0


def _crowded_note(crowded: Sequence[tuple[str, int, int, int]]) -> str:
    """One line on the hosts whose CPU workers want more threads than the host has cores
    (``Resources.crowded_hosts``): the first of them, how many, and what running them so means."""
    host, workers, threads, cores = crowded[0]
    more = f" and {len(crowded) - 1} more" if len(crowded) > 1 else ""
    return (f"note: the CPU workers of {host} ({workers} wanting {threads} threads of its {cores} cores)"
            f"{more} take turns on their cores; the plans are priced so, and fewer workers per host or fewer "
            "threads each (a worker's cpus) run each one faster")
