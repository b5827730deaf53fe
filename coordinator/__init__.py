"""cellmesh coordinator: plans and drives training."""

from coordinator.cutting import CUTTERS, CutError, CutProblem, Cutter, cut_even, cut_min_max, register_cutter
from coordinator.graph import CutInfo, Graph, TensorMeta, build_graph
from coordinator.plan import Plan, StagePlan
from coordinator.planner import PlanningError, candidate_plans, choose_plan, cut_problem, format_candidates
from coordinator.profile import NodeProfile, Profile, profile_graph
from coordinator.resources import Link, Resources, Worker
from coordinator.schedules import (
    Action,
    ActionKind,
    Schedule,
    ScheduleError,
    build_schedule,
    validate_schedule,
)
from coordinator.simulator import SimResult, StageCosts, draw_timeline, simulate

__all__ = [
    "CUTTERS",
    "Action",
    "ActionKind",
    "CutError",
    "CutInfo",
    "CutProblem",
    "Cutter",
    "Graph",
    "Link",
    "NodeProfile",
    "Plan",
    "PlanningError",
    "Profile",
    "Resources",
    "Schedule",
    "ScheduleError",
    "SimResult",
    "StageCosts",
    "StagePlan",
    "TensorMeta",
    "Worker",
    "build_graph",
    "build_schedule",
    "candidate_plans",
    "choose_plan",
    "cut_even",
    "cut_min_max",
    "cut_problem",
    "draw_timeline",
    "format_candidates",
    "profile_graph",
    "register_cutter",
    "simulate",
    "validate_schedule",
]
