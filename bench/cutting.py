"""The min-max cutter's two paths side by side: the band (numpy) and the compiled programme (numba).

For each resource list, one free search (``choose_plan``, 1,000 synthetic nodes over 1,024 workers, as
``bench/planning.py`` plans them) is run with every long chain on the band, and each cut it makes is kept
(the problems the search really cuts: within memory and ignoring it, at every stage count and pace it
tries). The kept problems are then cut again on each path, in this process's CPU time, and the
boundaries compared. The compiled path's load (numba's import and its cached code, or a first compile)
is timed apart, once.

    python bench/cutting.py [--lists random-2,random-5,random-9,random-12] [--json F]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = str(Path(__file__).resolve().parents[1])
if __name__ == "__main__":  # run as a script: the repository, not bench/, first on the path
    sys.path[0] = ROOT

from bench.planning import profile, resources  # noqa: E402
from coordinator.planning import compiled_cut, cutting  # noqa: E402
from coordinator.planning.config import PlanConfig  # noqa: E402
from coordinator.planning.cutting import CutError, CutProblem, cut_min_max  # noqa: E402
from coordinator.planning.planner import choose_plan  # noqa: E402


def collect(kind: str, nodes: int = 1000, workers: int = 1024) -> list[CutProblem]:
    """The long chains one free search on ``kind`` cuts (each once), all on the band."""
    kept: dict[int, CutProblem] = {}
    band_cut, long = cutting._band_cut, compiled_cut.COMPILED_FROM

    def keep(problem: CutProblem, least: float) -> tuple[int, ...] | None:
        if problem.num_stages > 1 and problem.num_nodes * problem.num_stages >= long:
            kept[id(problem)] = problem
        return band_cut(problem, least)

    cutting._band_cut = keep  # type: ignore[assignment]
    compiled_cut.COMPILED_FROM = sys.maxsize  # every chain on the band
    try:
        choose_plan(profile(nodes, kind), resources(kind, workers), PlanConfig(), global_batch=4 * workers)
    finally:
        cutting._band_cut = band_cut  # type: ignore[assignment]
        compiled_cut.COMPILED_FROM = long
    return list(kept.values())


def cut_all(problems: list[CutProblem], compiled: bool) -> tuple[list[tuple[int, ...] | None], float]:
    """Every problem cut on one path: the boundaries (None: none fits) and the CPU seconds."""
    saved = compiled_cut.COMPILED_FROM, compiled_cut.BAND_BUDGET_S
    compiled_cut.COMPILED_FROM, compiled_cut.BAND_BUDGET_S = (0, 0.0) if compiled else (sys.maxsize, 0.0)
    found: list[tuple[int, ...] | None] = []
    started = time.process_time()
    try:
        for problem in problems:
            try:
                found.append(cut_min_max(problem))
            except CutError:
                found.append(None)
    finally:
        compiled_cut.COMPILED_FROM, compiled_cut.BAND_BUDGET_S = saved
    return found, time.process_time() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lists", default="random-2,random-5,random-9,random-12",
                        help="random lists of bench/planning.py (random-0 .. random-15), comma-separated")
    parser.add_argument("--json", default="", help="write the rows here too")
    args = parser.parse_args()
    started = time.process_time()
    if not compiled_cut.available():
        raise SystemExit("numba cannot be imported here (pip install 'cellmesh[fast]'): the band alone cuts")
    sample = CutProblem(tuple(float(i % 7 + 1) for i in range(64)), (0.1,) * 65, 64)
    cut_all([sample], compiled=True)
    load = time.process_time() - started
    print(f"the compiled path's load (numba's import, its code from the cache or compiled): {load:.2f} s CPU")
    print(f"{'list':12s} {'cuts':>6s} {'memory':>7s} {'stages':>9s} {'band s':>8s} {'compiled s':>11s} "
          f"{'ratio':>6s} {'same':>5s}")
    rows: list[dict[str, Any]] = []
    for kind in args.lists.split(","):
        problems = collect(kind)
        band, band_s = cut_all(problems, compiled=False)
        fast, fast_s = cut_all(problems, compiled=True)
        row = {"list": kind, "cuts": len(problems), "within_memory": sum(p.memory_limit is not None
                                                                         for p in problems),
               "stages": [min(p.num_stages for p in problems), max(p.num_stages for p in problems)],
               "band_s": band_s, "compiled_s": fast_s, "same": band == fast}
        rows.append(row)
        low, high = row["stages"]
        print(f"{kind:12s} {row['cuts']:6d} {row['within_memory']:7d} {low:4d}-{high:<4d} "
              f"{band_s:8.2f} {fast_s:11.2f} {band_s / max(fast_s, 1e-9):5.1f}x {row['same']!s:>5s}")
    if args.json:
        Path(args.json).write_text(json.dumps({"load_s": load, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
