"""Planning: the dependency graph (DAG) of the actions of a protocol document."""

from cortex_worker.plan.dag import Plan, PlanIssue, PlanNode, build_plan

__all__ = ["Plan", "PlanIssue", "PlanNode", "build_plan"]
