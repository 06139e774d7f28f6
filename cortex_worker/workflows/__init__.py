"""Workflows (`kind: Workflow`): named DAGs of steps, run as jobs (docs/workflows.md).

`spec` holds the manifest model and its checks of one manifest alone, `link` checks the steps
against every manifest loaded (through the action-type table), `output` renders a run's result,
`action` runs `type="workflow"` actions as child jobs. `link` is not imported here: it sits
above the action-type table, which imports `spec` (and so this package). Submitting and finishing a run live with
the other jobs in `cortex_worker.jobs.lifecycle`; what differs is `kinds.WorkflowKind`.
"""

from cortex_worker.workflows.output import failure_message, output_names, render_output
from cortex_worker.workflows.spec import (
    INPUTS,
    WorkflowSpec,
    WorkflowStep,
    check_workflow,
    workflow_plan,
)

__all__ = [
    "INPUTS",
    "WorkflowSpec",
    "WorkflowStep",
    "check_workflow",
    "failure_message",
    "output_names",
    "render_output",
    "workflow_plan",
]
