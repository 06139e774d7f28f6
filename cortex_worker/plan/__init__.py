"""Planning: the dependency graph (DAG) of the actions of a protocol document."""

from cortex_worker.plan.dag import Plan, PlanIssue, PlanNode, build_plan
from cortex_worker.plan.stream import StreamPlanner

__all__ = ["Plan", "PlanIssue", "PlanNode", "StreamPlanner", "build_plan"]
