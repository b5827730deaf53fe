"""cellmesh coordinator: plans and drives training."""

from coordinator.cutting import CUTTERS, CutError, CutProblem, Cutter, cut_even, cut_min_max, register_cutter
from coordinator.data import BatchSampler, split_batch
from coordinator.graph import CutInfo, Graph, TensorMeta, build_graph
from coordinator.harness import LocalHarness
from coordinator.job import FitResult, Job
from coordinator.plan import Plan, StagePlan
from coordinator.planner import PlanningError, candidate_plans, choose_plan, cut_problem, format_candidates
from coordinator.profile import NodeProfile, Profile, profile_graph
from coordinator.reference import train_reference
from coordinator.resources import Link, Resources, Worker
from coordinator.runtime import ActionEvent, JobFailed, StepRecord
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
    "ActionEvent",
    "ActionKind",
    "BatchSampler",
    "CutError",
    "CutInfo",
    "CutProblem",
    "Cutter",
    "FitResult",
    "Graph",
    "Job",
    "JobFailed",
    "Link",
    "LocalHarness",
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
    "StepRecord",
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
    "split_batch",
    "train_reference",
    "validate_schedule",
]
