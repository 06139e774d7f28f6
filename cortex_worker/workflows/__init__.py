"""Workflows (`kind: Workflow`): named DAGs of steps, run as jobs (docs/workflows.md).

`spec` holds the manifest model and its load-time checks, `output` renders a run's result,
`runner` runs `type="workflow"` actions as child jobs. Submitting and finishing a run live with
the other jobs in `cortex_worker.jobs`; what differs is `kinds.WorkflowKind`.
"""

from cortex_worker.workflows.output import failure_message, output_names, render_output
from cortex_worker.workflows.spec import (
    INPUTS,
    WorkflowSpec,
    WorkflowStep,
    check_workflow,
    input_errors,
    link_workflow,
    prepare_inputs,
    workflow_plan,
)

__all__ = [
    "INPUTS",
    "WorkflowSpec",
    "WorkflowStep",
    "check_workflow",
    "failure_message",
    "input_errors",
    "link_workflow",
    "output_names",
    "prepare_inputs",
    "render_output",
    "workflow_plan",
]
