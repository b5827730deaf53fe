"""Planning, with no processes: graph, profile, cutting, schedules, simulator, planner."""
