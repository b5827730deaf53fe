"""``cellmesh plan JOB``: the plan a run would use and its predicted step, without starting a worker.

It loads the job as ``cellmesh run`` does (the same config flags: ``--workers 4``,
``--stages 2``...), profiles it on a sample microbatch in this process, asks the planner,
and prints the plan's table and the simulator's per-stage summary of one step
(``coordinator/planning/prediction.py``). ``--timeline FILE`` draws that predicted step
(``draw_timeline``: ``.svg`` with no dependency, ``.png``/``.pdf`` with matplotlib, the
``plot`` extra). The same prediction sits beside the measured steps in a run's trace.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from coordinator.commands.jobspec import load_job
from coordinator.commands.output import apply_logging
from coordinator.commands.run import REPORTED, report
from coordinator.planning.prediction import predict
from coordinator.planning.simulator import draw_timeline
from coordinator.planning.timeline_plot import check_drawable

__all__ = ["plan_command"]


def plan_command(job: str, settings: Mapping[str, Any], timeline: Path | None, *, out: TextIO | None = None,
                 show_traceback: bool = False) -> int:
    """Print ``job``'s plan and predicted step; draw it to ``timeline`` if given. Returns the exit code."""
    out = out or sys.stdout
    try:
        if timeline is not None:
            check_drawable(timeline)  # before the profiling, not after
        loaded = load_job(job, settings)
        apply_logging(loaded.job.config.logging)
        plan = loaded.job.plan()
        result = predict(plan)
        print(f"{plan}\n\npredicted step of the schedule (simulated, before gradient sync and messages):\n"
              f"{result.summary()}", file=out, flush=True)
        if timeline is not None:
            title = (f"{loaded.name}: {plan.summary()}; pipeline {result.step_time_s * 1e3:.3f} ms, "
                     f"bubble {result.bubble_fraction:.1%}")
            draw_timeline(result, timeline, title=title)
            print(f"predicted timeline written to {timeline}", file=out, flush=True)
    except REPORTED as exc:
        return report(exc, show_traceback=show_traceback)
    return 0
