"""`type="llm"`: one completion on the job's model, its prompt the task and its parameters."""

from __future__ import annotations

from cortex_worker.actions.types.base import ActionType, Problem, Target, on


def check(target: Target) -> list[Problem]:
    if target.llm_model is not None:
        return []
    return [("unsupported_action", target.word(target.wording.no_model))]


TYPE = ActionType("llm", check, "cortex_worker.llm.action:run_llm_action", on("llm"),
                  feed_source=True, workflow_step=True, needs_model=True)
